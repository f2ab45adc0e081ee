"""The paged KV pool on the device and the pinned host tier pages are swapped to.

One allocation ``[num_blocks][num_layers][2 (K,V)][block_size][KVH][D]`` bf16: the
block is the outermost index, so one block (every layer, K and V) is contiguous
and a swap is one memcpy. The host tier is pinned on the first swap-out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.backends.cuda.forward import KVLayout
from engine.memory import kv_block_bytes
from engine.model_config import ModelConfig

_GiB = 1 << 30
HEADROOM = _GiB  # left free beside the pool: graphs, modules, the runtime's own allocations


def kv_budget(gpu_budget: float, *, free_at_load: int, used_by_load: int, free_now: int, block_bytes: int) -> int:
    """Bytes of the KV pool under ``model.gpu_budget``: the load's budget (``gpu_budget`` <= 1: that
    fraction of ``free_at_load``, the card's free memory when the load began; above 1: bytes) less
    what the load already took (weights, workspace, staging), and never more than the card has free
    now less ``HEADROOM``. A budget over the free memory, or one the weights and workspace leave no
    block of, is a ValueError with the numbers."""
    if gpu_budget <= 1.0:
        budget, said = int(free_at_load * gpu_budget), f"{gpu_budget:g} of the {free_at_load} B free at load = "
    else:
        budget, said = int(gpu_budget), ""
        if budget > free_at_load:
            raise ValueError(f"model.gpu_budget {budget} B is more than the card's {free_at_load} B free at load")
    kv = min(budget - used_by_load, free_now - HEADROOM)
    if kv < block_bytes:
        raise ValueError(
            f"model.gpu_budget {said}{budget} B: the weights and workspace took {used_by_load} B, leaving "
            f"{max(kv, 0)} B for the KV pool, less than one {block_bytes} B block (raise model.gpu_budget)"
        )
    return kv


class KVPool:
    def __init__(self, cfg: ModelConfig, block_size: int, mem, kv_budget_bytes: int | None,
                 host_kv_budget_bytes: int, *, gpu_budget: float = 0.9, free_at_load: int = 0) -> None:  # fmt: skip
        """Size the pool: ``kv_budget_bytes`` (a draft model's ``spec.draft_kv``), or what
        ``model.gpu_budget`` leaves of the card once the load's other allocations (``mem``) are made."""
        import pycuda.driver as cuda

        self.block_bytes = kv_block_bytes(cfg, block_size, bytes_per_value=2)
        if kv_budget_bytes is None:
            free, _total = cuda.mem_get_info()
            kv_budget_bytes = kv_budget(gpu_budget, free_at_load=free_at_load or free, used_by_load=mem.nbytes,
                                        free_now=free, block_bytes=self.block_bytes)  # fmt: skip
        self.num_blocks = int(kv_budget_bytes // self.block_bytes)
        if self.num_blocks < 1:
            raise ValueError(f"KV budget {kv_budget_bytes} B holds no block of {self.block_bytes} B")
        self.base = mem.alloc(self.num_blocks * self.block_bytes)
        cuda.memset_d8(self.base, 0, self.num_blocks * self.block_bytes)
        layer_stride = 2 * block_size * cfg.num_kv_heads * cfg.head_dim
        self.layout = KVLayout(self.base, block_size, layer_stride, cfg.num_layers * layer_stride)
        self.num_host_blocks = int(host_kv_budget_bytes // self.block_bytes)
        self.host = None

    def swap_out(self, pairs: Sequence[tuple[int, int]], stream) -> None:
        """Copy (device block, host block) pairs to the host tier."""
        self._copy(pairs, stream, to_host=True)

    def swap_in(self, pairs: Sequence[tuple[int, int]], stream) -> None:
        """Copy (host block, device block) pairs back to the device."""
        self._copy([(d, h) for h, d in pairs], stream, to_host=False)

    def _copy(self, pairs: Sequence[tuple[int, int]], stream, *, to_host: bool) -> None:
        """(device block, host block) pairs, one memcpy a block, then wait."""
        import pycuda.driver as cuda

        host, bb = self._host(), self.block_bytes
        for dev, hb in pairs:
            if to_host:
                cuda.memcpy_dtoh_async(host[hb * bb : (hb + 1) * bb], self.base + dev * bb, stream)
            else:
                cuda.memcpy_htod_async(self.base + dev * bb, host[hb * bb : (hb + 1) * bb], stream)
        stream.synchronize()

    def _host(self):
        import pycuda.driver as cuda

        if self.host is None:
            if self.num_host_blocks < 1:
                raise RuntimeError("no host KV tier (host_kv_budget_bytes too small)")
            self.host = cuda.pagelocked_empty(self.num_host_blocks * self.block_bytes, np.uint8)
        return self.host
