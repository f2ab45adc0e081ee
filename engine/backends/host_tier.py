"""The host KV tier of the CPU-side backends (numpy, cpu): swapped pages in host RAM.

A backend keeps its pool as two arrays ``k``, ``v`` of ``[layers, num_blocks,
block_size, kv_heads, head_dim]`` and the tier's size as ``num_host_blocks``;
the tier is ``host_k``, ``host_v`` of the same layout over ``num_host_blocks``
blocks and the pool's dtype (numpy's float32, the cpu backend's float16), None
until the first swap-out, so a server that never swaps holds none of it.
Swaps copy whole pages, every layer, K and V alike, so a swapped-in page is the
page that went out bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def host_pages(backend) -> tuple[np.ndarray, np.ndarray]:
    """``(host_k, host_v)``, allocated on the first call like the pool, over ``num_host_blocks`` blocks."""
    if backend.host_k is None:
        if backend.num_host_blocks < 1:
            raise RuntimeError("no host KV tier (host_kv_budget_bytes too small)")
        k = backend.k
        shape = (k.shape[0], backend.num_host_blocks, *k.shape[2:])
        backend.host_k, backend.host_v = np.zeros(shape, k.dtype), np.zeros(shape, k.dtype)
    return backend.host_k, backend.host_v


def swap_out(backend, pairs: Sequence[tuple[int, int]]) -> None:
    """(pool block, host block) pairs: pool pages to the host tier."""
    copy_blocks((backend.k, backend.v), host_pages(backend), pairs)


def swap_in(backend, pairs: Sequence[tuple[int, int]]) -> None:
    """(host block, pool block) pairs: host pages back into the pool."""
    copy_blocks(host_pages(backend), (backend.k, backend.v), pairs)


def copy_blocks(src: tuple[np.ndarray, ...], dst: tuple[np.ndarray, ...], pairs: Sequence[tuple[int, int]]) -> None:
    """``dst[:, b] = src[:, a]`` for each (a, b) pair, every layer, K and V alike."""
    if not pairs:
        return
    a, b = (list(x) for x in zip(*pairs))
    for s, d in zip(src, dst):
        d[:, b] = s[:, a]
