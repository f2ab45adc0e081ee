"""bf16 weights kept as stored, for a backend that holds bf16 (the CUDA backend's ``takes_bf16``).

A bf16 safetensors tensor read as float32 doubles the host RAM a load needs (a 30B model's
61 GB of bf16 is 122 GB of float32, more than the GPU machine's 128 GB) and costs two passes
over it (widen, then round back). Kept as stored, a tensor is an ndarray of the 2-byte void
dtype ``BF16`` holding the bf16 bit patterns: every data movement a definition's ``from_hf``
does (renames, row views of fused tensors, expert slices, stacks and transposes) works on it
unchanged, while any arithmetic raises (numpy has no arithmetic on void), so code that wants
numbers cannot silently compute on bits: it goes through ``to_float32`` (exact).
"""

from __future__ import annotations

import numpy as np

BF16 = np.dtype((np.void, 2))


def is_bf16(a) -> bool:
    """Whether ``a`` is a bf16 tensor kept as stored."""
    return isinstance(a, np.ndarray) and a.dtype == BF16


def from_bits(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> a ``BF16`` tensor (a view, no copy)."""
    return np.asarray(bits, dtype="<u2").view(BF16)


def bits(a: np.ndarray) -> np.ndarray:
    """A ``BF16`` tensor's bit patterns as a contiguous uint16 array (what goes up to the card)."""
    return np.ascontiguousarray(a).view(np.uint16)


def to_float32(a: np.ndarray) -> np.ndarray:
    """A ``BF16`` tensor as float32, exactly (bf16 is the top half of an IEEE float32)."""
    return (bits(a).astype(np.uint32) << np.uint32(16)).view(np.float32)
