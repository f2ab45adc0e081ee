"""MXFP4 weights (gpt-oss's experts): dequantized to float32 at load, or kept as stored.

A checkpoint whose config.json says ``quantization_config.quant_method ==
"mxfp4"`` stores each quantized tensor ``X`` as two uint8 tensors:
``X_blocks`` ``[..., rows, G, 16]`` (two e2m1 values a byte, the low nibble
first) and ``X_scales`` ``[..., rows, G]`` (one e8m0 exponent per block of 32
values: scale ``2 ** (s - 127)``). gpt-oss stores its experts this way
(``mlp.experts.gate_up_proj`` and ``down_proj``), rows being each expert's
*output* features.

:func:`dequantize` gives the float32 values exactly as transformers'
``convert_moe_packed_tensors`` does (the same value table, nibble order and
``ldexp``); :func:`join_pairs` swaps each completed pair for the tensor
transformers itself would load, ``X`` ``[..., in, out]`` (its fused experts'
layout), so a model definition maps one layout whether the checkpoint was
quantized or not. For a backend that takes MXFP4 as stored, ``join_pairs(keep=True)``
makes each pair an :class:`Mxfp4Tensor` ``[..., out, in]`` instead (4.25 bits a weight),
and :func:`from_ggml` makes one from llama.cpp's MXFP4 blocks (GGML type 39).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

# e2m1: sign bit, two exponent bits, one mantissa bit; index = the nibble.
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values a scale covers
GGML_BLOCK = 1 + BLOCK // 2  # bytes of a GGML MXFP4 block: the e8m0 scale, then the nibbles


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., G, B]`` uint8 blocks and ``[..., G]`` uint8 scales -> float32 ``[..., G * 2B]``.

    Byte ``j`` of a block holds value ``2j`` in its low nibble and ``2j + 1`` in its high one.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1)  # [..., G, B, 2]
    exponent = scales.astype(np.int32) - 127
    with np.errstate(over="ignore"):  # scale 255 (e8m0's NaN) overflows to inf, as transformers' ldexp does
        out = np.ldexp(values.reshape(*scales.shape, -1), exponent[..., None])
    return out.reshape(*scales.shape[:-1], -1)


def dequantize_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A stacked ``[experts, out, G, B]`` tensor as transformers loads it: float32 ``[experts, in, out]``."""
    return np.ascontiguousarray(dequantize(blocks, scales).swapaxes(-1, -2))


@dataclass(frozen=True)
class Mxfp4Tensor:
    """A matrix ``[out, in]`` (or a stack ``[..., out, in]``) kept as MXFP4.

    ``blocks`` uint8 ``[..., out, in // 32, 16]``: byte ``j`` of a block holds value ``2j`` in its
    low nibble and ``2j + 1`` in its high one (the checkpoint's order); ``scales`` uint8
    ``[..., out, in // 32]``, e8m0: scale ``2 ** (s - 127)``.
    """

    blocks: np.ndarray
    scales: np.ndarray

    def __post_init__(self) -> None:
        if self.blocks.dtype != np.uint8 or self.scales.dtype != np.uint8:
            raise ValueError(f"mxfp4: blocks and scales must be uint8 (got {self.blocks.dtype}, {self.scales.dtype})")
        if self.scales.ndim < 1 or self.blocks.shape != (*self.scales.shape, BLOCK // 2):
            raise ValueError(
                f"mxfp4: blocks {self.blocks.shape} do not match scales {self.scales.shape} "
                "(blocks [..., G, 16], scales [..., G])"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 ``[..., out, in]`` (:func:`dequantize`)."""
        return dequantize(self.blocks, self.scales)

    def rows(self, index) -> Mxfp4Tensor:
        """The rows (axis -2 of ``shape``) that ``index``, a slice or an integer array, picks: views of
        these arrays for a slice (gpt-oss's gate and up rows of a load: no copy), copies otherwise."""
        return Mxfp4Tensor(self.blocks[..., index, :, :], self.scales[..., index, :])

    def __getitem__(self, index) -> Mxfp4Tensor:
        """The leading axis indexed: ``t[e]`` is expert ``e``'s ``[out, in]`` of a stack."""
        return Mxfp4Tensor(self.blocks[index], self.scales[index])


def from_ggml(data: np.ndarray, shape: tuple[int, ...]) -> Mxfp4Tensor:
    """llama.cpp's MXFP4 tensor of numpy shape ``[..., out, in]`` (its bytes: each row ``in // 32``
    blocks of ``GGML_BLOCK``, value ``j`` of a block in the low nibble of byte ``1 + j`` and value
    ``j + 16`` in the high one) -> :class:`Mxfp4Tensor`. GGML's table is e2m1's doubled and its
    scale ``2 ** (e - 128)``: the same values, so the scale bytes carry over."""
    *rows, k = shape
    if k % BLOCK:
        raise ValueError(f"mxfp4: a row of {k} values is not whole blocks of {BLOCK}")
    raw = np.asarray(data, dtype=np.uint8).reshape(*rows, k // BLOCK, GGML_BLOCK)
    qs = raw[..., 1:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., G, 32]: value j's nibble at j
    return Mxfp4Tensor(values[..., 0::2] | (values[..., 1::2] << 4), np.ascontiguousarray(raw[..., 0]))


def join_pairs(
    tensors: Mapping[str, np.ndarray], pending: dict[str, np.ndarray], keep: bool = False
) -> dict[str, np.ndarray | Mxfp4Tensor]:
    """``tensors`` with every ``X_blocks`` / ``X_scales`` pair replaced by ``X``: :func:`dequantize_hf`'s
    float32 ``[..., in, out]``, or with ``keep`` the :class:`Mxfp4Tensor` ``[..., out, in]``.

    A half whose partner is not here (sharded checkpoints may split a pair across files) waits in
    ``pending`` until a later call brings it; whatever is left there at the end is an incomplete pair.
    """
    out: dict[str, np.ndarray | Mxfp4Tensor] = {}
    for name, w in tensors.items():
        if not name.endswith((BLOCKS, SCALES)):
            out[name] = w
            continue
        pending[name] = w
        base = name[: -len(BLOCKS)]
        if base + BLOCKS in pending and base + SCALES in pending:
            blocks, scales = pending.pop(base + BLOCKS), pending.pop(base + SCALES)
            out[base] = Mxfp4Tensor(blocks, scales) if keep else dequantize_hf(blocks, scales)
    return out
