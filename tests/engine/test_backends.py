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
