"""MXFP4 weights in safetensors (gpt-oss), dequantized to float32 at load.

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
quantized or not.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# e2m1: sign bit, two exponent bits, one mantissa bit; index = the nibble.
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
BLOCKS, SCALES = "_blocks", "_scales"


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


def join_pairs(tensors: Mapping[str, np.ndarray], pending: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` with every ``X_blocks`` / ``X_scales`` pair replaced by ``X`` (:func:`dequantize_hf`).

    A half whose partner is not here (sharded checkpoints may split a pair across files) waits in
    ``pending`` until a later call brings it; whatever is left there at the end is an incomplete pair.
    """
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        if not name.endswith((BLOCKS, SCALES)):
            out[name] = w
            continue
        pending[name] = w
        base = name[: -len(BLOCKS)]
        if base + BLOCKS in pending and base + SCALES in pending:
            out[base] = dequantize_hf(pending.pop(base + BLOCKS), pending.pop(base + SCALES))
    return out
