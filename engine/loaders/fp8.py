"""FP8 (e4m3) weights: the tensor as stored, its encoding and decoding, quantization at load.

``float8_e4m3fn``: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
infinities; ``S.1111.111`` is NaN, so the largest finite value is 448 (``0x7E``)
and the smallest subnormal 2^-9. :func:`encode` rounds to nearest even and
saturates at +-448, bit for bit as ``torch.Tensor.to(torch.float8_e4m3fn)`` on
values inside the range (torch gives NaN past 464 instead of saturating);
:func:`decode` is exact (every e4m3 value is a float32).

A matrix ``[out, in]`` is stored as :class:`Fp8Tensor`: the e4m3 bytes and
float32 scales, either one per output row (``block`` None) or one per
``block x block`` tile (``block`` 128, the layout of Hugging Face's block-wise
FP8 checkpoints, whose ``weight_scale_inv`` is that tile's multiplier). The
value of element ``(o, i)`` is ``decode(data[o, i]) * scale[o]`` or ``* scale[o
// B, i // B]``. :func:`quantize_fp8` makes one from float weights with scale
``amax / 448`` (a row or tile of zeros gets scale 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

FP8_MAX = 448.0
NAN = 0x7F  # e4m3fn's NaN code (the sign bit set: 0xFF)
_SUBNORMAL_MIN_NORMAL = 2.0**-6  # below this, values are subnormal: code = rint(|x| * 2^9)


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A matrix ``[out, in]`` as e4m3 bytes with float32 scales (see the module docstring)."""

    shape: tuple[int, int]  # [out, in]
    data: np.ndarray  # uint8 [out, in], float8_e4m3fn bit patterns
    scale: np.ndarray  # float32 [out] (per output channel) or [ceil(out/B), ceil(in/B)] (blocks)
    block: int | None  # None: per output channel; B (128): BxB blocks

    def __post_init__(self) -> None:
        out, k = self.shape
        if self.data.dtype != np.uint8 or self.data.shape != (out, k):
            raise ValueError(f"fp8: data must be uint8 {self.shape}, got {self.data.dtype} {self.data.shape}")
        want = (out,) if self.block is None else (-(-out // self.block), -(-k // self.block))
        if self.scale.dtype != np.float32 or self.scale.shape != want:
            raise ValueError(f"fp8: scale must be float32 {want}, got {self.scale.dtype} {self.scale.shape}")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def scale_per_element(self) -> np.ndarray:
        """The scales broadcast to ``[out, in]`` (or ``[out, 1]`` per channel)."""
        if self.block is None:
            return self.scale[:, None]
        out, k = self.shape
        b = self.block
        return np.repeat(np.repeat(self.scale, b, axis=0), b, axis=1)[:out, :k]

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``: each e4m3 value times its scale (one float32 product)."""
        return decode(self.data) * self.scale_per_element()


def _decode_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    mant = (codes & 0x7).astype(np.float64)
    value = np.where(exp == 0, mant / 8 * 2.0**-6, (1 + mant / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    value = np.where((codes & 0x7F) == NAN, np.nan, value)
    return (sign * value).astype(np.float32)


DECODE = _decode_table()  # code -> float32


def decode(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3 bit patterns -> float32 (exact)."""
    return DECODE[codes]


def encode(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e4m3 bit patterns: round to nearest even, saturate to +-448, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    sign = (np.signbit(x).astype(np.uint8)) << 7
    a = np.minimum(np.abs(x), np.float32(FP8_MAX))  # NaN stays NaN through minimum
    bits = a.view(np.uint32)
    # Normal: keep 3 of float32's 23 mantissa bits, rounding the 20 dropped ones to nearest even;
    # the carry of a rounding runs into the exponent, as it should. Rebias 127 -> 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal (and zero): multiples of 2^-9; rint rounds half to even, and 8 is 2^-6's code.
    small = np.rint(a * np.float32(512.0))
    with np.errstate(invalid="ignore"):
        code = np.where(a < _SUBNORMAL_MIN_NORMAL, small, normal.astype(np.float32)).astype(np.uint8)
    code = np.where(np.isnan(a), np.uint8(NAN), code)
    return (code | sign).astype(np.uint8)


def quantize_fp8(w: np.ndarray, block: int | None = None) -> Fp8Tensor:
    """float ``[out, in]`` -> :class:`Fp8Tensor`, scales ``amax / 448`` per output row or per ``block`` tile."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"fp8: a matrix [out, in] is quantized, got shape {w.shape}")
    out, k = w.shape
    if block is None:
        amax = np.abs(w).max(axis=1)
    else:
        rb, cb = -(-out // block), -(-k // block)
        padded = np.zeros((rb * block, cb * block), np.float32)
        padded[:out, :k] = np.abs(w)
        amax = padded.reshape(rb, block, cb, block).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    t = Fp8Tensor((out, k), np.zeros((out, k), np.uint8), scale, block)
    data = encode(w / t.scale_per_element())
    return dataclasses.replace(t, data=data)


def is_quantizable(name: str, w: np.ndarray) -> bool:
    """A matrix that ``model.weight_format = fp8`` stores as e4m3: every 2-D projection in the
    layers; the embedding, the head, norms and vectors stay float (as FP8 checkpoints keep them)."""
    if not (isinstance(w, np.ndarray) and w.ndim == 2 and name.startswith("model.layers.")):
        return False
    return name.endswith("_proj.weight")  # not an MoE router (mlp.gate.weight): its few rows pick the experts


def quantize_weights(weights: dict, block: int | None = None) -> dict:
    """``weights`` with every :func:`is_quantizable` matrix replaced by its :class:`Fp8Tensor`."""
    return {n: quantize_fp8(w, block) if is_quantizable(n, w) else w for n, w in weights.items()}


# --- Hugging Face FP8 checkpoints -----------------------------------------------------------

SCALE_INV, SCALE, INPUT_SCALE = "_scale_inv", "_scale", ".input_scale"


def checkpoint_block(quantization_config: dict) -> int | None:
    """The tile side of a ``quant_method: fp8`` checkpoint (None: per tensor or channel); ValueError
    for what the loader does not read (e5m2 values, non-square tiles)."""
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r}: only e4m3 (float8_e4m3fn) FP8 weights are read")
    size = quantization_config.get("weight_block_size")
    if size is None:
        return None
    if len(size) != 2 or size[0] != size[1] or int(size[0]) < 1:
        raise ValueError(f"quantization_config.weight_block_size {size}: square tiles [B, B] only")
    return int(size[0])


def _stored(data: np.ndarray, scale: np.ndarray, name: str, block: int | None) -> Fp8Tensor:
    """An fp8 matrix and its ``weight_scale_inv`` (tiles) or ``weight_scale`` (tensor or channel)."""
    out = data.shape[0]
    scale = np.asarray(scale, dtype=np.float32)
    if name.endswith(SCALE_INV) and scale.ndim == 2:
        if block is None:
            raise ValueError(f"{name}: block scales without quantization_config.weight_block_size")
        return Fp8Tensor(data.shape, data, np.ascontiguousarray(scale), block)
    if scale.size == 1:
        return Fp8Tensor(data.shape, data, np.full(out, scale.reshape(-1)[0], np.float32), None)
    if scale.size == out:
        return Fp8Tensor(data.shape, data, np.ascontiguousarray(scale.reshape(out)), None)
    raise ValueError(f"{name}: scale of shape {scale.shape} fits neither the tensor, its rows nor its tiles")


def join_scales(tensors: dict, pending: dict, *, block: int | None, keep: bool) -> dict:
    """``tensors`` with each fp8 ``X.weight`` (raw uint8) and its scale joined into ``X.weight``:
    an :class:`Fp8Tensor` (``keep``, 2-D only) or its float32 dequantization. Activation scales
    (``X.input_scale``) are dropped: activations stay float. A half whose partner is in a later
    shard waits in ``pending``."""
    out: dict = {}
    for name, w in tensors.items():
        if name.endswith(INPUT_SCALE):
            continue
        if name.endswith((SCALE_INV, SCALE)) or (w.dtype == np.uint8 and name.endswith(".weight")):
            pending[name] = w
            base = name.removesuffix(SCALE_INV).removesuffix(SCALE)
            scale_name = next((base + s for s in (SCALE_INV, SCALE) if base + s in pending), None)
            if base in pending and scale_name is not None:
                data, scale = pending.pop(base), pending.pop(scale_name)
                if data.ndim != 2:  # stacked experts: each 2-D slice with its own scales
                    out[base] = np.stack([_stored(d, s, scale_name, block).dequantize() for d, s in zip(data, scale)])
                    continue
                t = _stored(np.ascontiguousarray(data), scale, scale_name, block)
                out[base] = t if keep else t.dequantize()
            continue
        out[name] = w
    return out


def map_rows(t: Fp8Tensor, rename) -> dict[str, Fp8Tensor]:
    """``rename(array) -> {canonical: row view}`` (a definition's ``from_hf`` for one name) applied
    to an :class:`Fp8Tensor`: its bytes and its per-row scales split alike. A fused tensor with
    tiles splits only on tile boundaries."""
    rows = t.scale[:, None] if t.block is None else np.repeat(t.scale, t.block, axis=0)[: t.shape[0]]
    datas, scales = rename(t.data), rename(rows)
    out = {}
    for name, d in datas.items():
        s = scales[name]
        if t.block is None:
            s = s[:, 0]
        else:
            tiles = s[:: t.block]
            if not np.array_equal(np.repeat(tiles, t.block, axis=0)[: d.shape[0]], s):
                raise ValueError(f"{name}: a fused fp8 tensor split off its {t.block}-row tiles")
            s = tiles
        out[name] = Fp8Tensor(tuple(d.shape), np.ascontiguousarray(d), np.ascontiguousarray(s), t.block)
    return out
