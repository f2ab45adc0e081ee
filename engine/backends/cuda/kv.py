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


class KVPool:
    def __init__(self, cfg: ModelConfig, block_size: int, mem, kv_budget_bytes: int | None,
                 host_kv_budget_bytes: int) -> None:  # fmt: skip
        """Size the pool: ``kv_budget_bytes``, or what the card has left (92% of its free memory,
        less 1 GiB of headroom for graphs, modules and the runtime)."""
        import pycuda.driver as cuda

        self.block_bytes = kv_block_bytes(cfg, block_size, bytes_per_value=2)
        if kv_budget_bytes is None:
            free, _total = cuda.mem_get_info()
            kv_budget_bytes = int(free * 0.92) - _GiB
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
