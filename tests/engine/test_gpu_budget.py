"""model.gpu_budget: how much of the card one CUDA load may take (engine/backends/cuda/kv.py kv_budget).
Pure arithmetic, so it runs without a GPU; tests/kernels/test_cuda_model.py loads under a budget on the card."""

from __future__ import annotations

import pytest

from engine.backends.cuda.kv import HEADROOM, kv_budget

GiB = 1 << 30


def test_a_fraction_is_of_the_free_memory_at_load_less_what_the_load_took():
    got = kv_budget(0.5, free_at_load=100 * GiB, used_by_load=20 * GiB, free_now=80 * GiB, block_bytes=1 << 20)
    assert got == 30 * GiB  # half of 100, less the 20 the weights and workspace took


def test_bytes_above_one():
    got = kv_budget(40 * GiB, free_at_load=100 * GiB, used_by_load=10 * GiB, free_now=90 * GiB, block_bytes=1 << 20)
    assert got == 30 * GiB


def test_never_more_than_the_card_has_free_now_less_headroom():
    # Someone else took memory during the load: the pool shrinks instead of failing to allocate.
    got = kv_budget(0.9, free_at_load=100 * GiB, used_by_load=10 * GiB, free_now=20 * GiB, block_bytes=1 << 20)
    assert got == 20 * GiB - HEADROOM


def test_a_budget_the_weights_overrun_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as err:
        kv_budget(0.1, free_at_load=100 * GiB, used_by_load=16 * GiB, free_now=84 * GiB, block_bytes=1 << 20)
    msg = str(err.value)
    assert "model.gpu_budget" in msg and str(10 * GiB) in msg and str(16 * GiB) in msg and str(1 << 20) in msg


def test_bytes_over_the_free_memory_are_refused():
    with pytest.raises(ValueError, match="more than the card's"):
        kv_budget(200 * GiB, free_at_load=100 * GiB, used_by_load=0, free_now=100 * GiB, block_bytes=1 << 20)


def test_the_key_reaches_the_backend_tuning():
    from engine.config import EngineConfig
    from ignis_site.config import engine_config_dict, load

    values = load(environ={"IGNIS_MODEL_GPU_BUDGET": "0.25"})
    assert EngineConfig.from_dict(engine_config_dict(values)).cuda.gpu_budget == 0.25
    assert load(environ={})["model.gpu_budget"] == 0.9
    with pytest.raises(ValueError):
        load(environ={"IGNIS_MODEL_GPU_BUDGET": "0"})
