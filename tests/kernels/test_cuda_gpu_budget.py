"""model.gpu_budget on the card: the KV pool takes what the budget leaves after the weights and
workspace, and a budget they overrun is refused before the pool is allocated."""

from __future__ import annotations

import pytest

from tests.kernels.gpu import requires_cuda
from tests.kernels.hf_models import DEFAULT_ROPE, QWEN_SMALL, random_model

pytestmark = [*requires_cuda, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def load(budget: float):
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.models import definition

    model, cfg = random_model("qwen2", DEFAULT_ROPE, **QWEN_SMALL)
    sd = model.state_dict()
    weights = {n: sd[n].float().cpu().numpy() for n in definition(cfg.arch).tensors(cfg)}
    be = CudaBackend(CudaTuning(gpu_budget=budget))
    plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=4096)
    return be, plan


def test_the_pool_takes_what_a_byte_budget_leaves():
    be, whole = load(0.9)  # the default: most of the card
    taken = be.mem.nbytes - whole.kv_bytes  # weights, workspace, staging
    be.unload()
    budget = taken + (256 << 20)
    be, plan = load(float(budget))
    try:
        assert plan.kv_bytes <= budget - taken
        assert plan.kv_bytes > budget - taken - plan.kv_bytes // plan.num_blocks  # whole blocks, none wasted
        assert plan.kv_bytes < whole.kv_bytes / 10
    finally:
        be.unload()


def test_a_fraction_is_of_the_free_memory():
    import pycuda.driver as cuda

    from engine.cu import runtime

    with runtime.current():
        free = cuda.mem_get_info()[0]
    be, plan = load(0.05)
    try:
        assert plan.kv_bytes <= 0.05 * free
        # Weights, workspace, staging and the pool together fill the 5% (to a block and the drift
        # of the free figure between the two readings).
        assert abs(be.mem.nbytes - 0.05 * free) < 0.002 * free
    finally:
        be.unload()


def test_a_budget_below_the_weights_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"model.gpu_budget \d+ B: the weights and workspace took \d+ B"):
        load(float(2 << 20))
