"""The backend factory hands each backend its knobs from the engine's configuration."""

from __future__ import annotations

import pytest

from engine.backends import create_backend
from engine.config import CudaTuning, EngineConfig
from engine.loading import create_backend as default_factory


def test_numpy_backend_takes_blas_threads_from_the_config():
    assert create_backend("numpy", EngineConfig(blas_threads=3)).blas_threads == 3
    assert create_backend("numpy").blas_threads == EngineConfig().blas_threads


def test_cuda_backend_takes_its_tuning_from_the_config():
    tuning = CudaTuning(gemv_u2_below=1234, kernel_cache_dir="/tmp/ignis-kernels")
    backend = create_backend("cuda", EngineConfig(cuda=tuning))  # constructing imports no PyCUDA
    assert backend.tuning == tuning


def test_the_hosts_default_factory_passes_the_config_through():
    cfg = EngineConfig(blas_threads=2)
    assert default_factory("numpy", cfg).blas_threads == 2


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        create_backend("tpu")


def test_a_step_says_when_the_prefill_was_queued_where_the_backend_marks_it():
    """Backend.step turns ``queued_at`` (set by a device backend once the prefill's last kernel is
    queued) into ``prefill_queued_seconds``, within the prefill's own seconds; None where a backend
    does not mark it, and a mark from an earlier step never carries over."""
    import time

    from engine.backend import Backend, PrefillSpan, StepPlan

    class Marking(Backend):
        mark = True

        def load(self, *args, **kwargs): ...

        def prefill(self, span, out):
            if self.mark:
                self.queued_at = time.perf_counter()
            out.prefill_token = 1

        def decode_round(self, lanes, out): ...

        def swap_out(self, pairs): ...

        def swap_in(self, pairs): ...

        def unload(self): ...

    backend = Marking()
    out = backend.step(StepPlan(prefill=PrefillSpan(seq_id=0, token_ids=[1, 2], start_pos=0, block_table=[0])))
    assert out.prefill_queued_seconds is not None and 0 <= out.prefill_queued_seconds <= out.prefill_seconds
    backend.mark = False
    out = backend.step(StepPlan(prefill=PrefillSpan(seq_id=0, token_ids=[1, 2], start_pos=0, block_table=[0])))
    assert out.prefill_queued_seconds is None
