"""A Q4_K_M-typed GGUF of a llama model made from another GGUF with the ``gguf`` package and the
numpy encoders below (no llama-quantize on the machine this was written on).

The types follow llama.cpp's choice for ``Q4_K_M`` (llama-quantize's ``llama_tensor_get_type``): Q4_K,
with Q6_K for ``attn_v`` and ``ffn_down`` in the layers ``use_more_bits`` picks and for the output
head (the token embedding when the head is tied); a matrix whose rows are not whole 256-value
super-blocks falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0). For SmolLM2-135M
(hidden 576, intermediate 1536) only ``ffn_down`` is a K-quant: 16 layers Q4_K, 14 Q6_K; q, k, o,
gate, up and half the v are Q5_0; the tied embedding and the other v are Q8_0.

The encoders are plain min/max ones, not llama.cpp's search for the best scales: the bytes and
the kernels' work are llama.cpp's, the rounding a little worse. The values come from the source
file dequantized (SmolLM2's Q4_1 file: Q4_1 weights re-encoded).

    .venv/bin/python bench/make_kquant_gguf.py models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import re

import numpy as np


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (Q4_K / Q5_K)."""
    s = np.zeros((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    s[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    s[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    return s


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q4_K rows [rows, k / 256 * 144]."""
    rows, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        ds, dm = d[:, None] * sc, dmin[:, None] * mn
        q = np.where(ds[..., None] > 0, np.rint((x + dm[..., None]) / ds[..., None]), 0).clip(0, 15).astype(np.uint8)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    out = np.concatenate([_half(d), _half(dmin), _pack_scale_min(sc, mn), qs], axis=1)
    return out.reshape(rows, k // 256 * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q6_K rows [rows, k / 256 * 210]."""
    rows, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=2) / 31.5
    d = (scale.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 127)
        ds = d[:, None] * sc
        q = np.where(ds[..., None] > 0, np.rint(x / ds[..., None]), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 128).astype(np.uint8)  # two halves of 128
    ql = (q[:, :, :64] & 15) | (q[:, :, 64:] & 15) << 4  # [n, 2, 64]
    hi = q >> 4  # [n, 2, 128], 2 bits each
    qh = hi[:, :, :32] | hi[:, :, 32:64] << 2 | hi[:, :, 64:96] << 4 | hi[:, :, 96:] << 6
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _half(d)], axis=1)
    return out.reshape(rows, k // 256 * 210)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q3_K rows [rows, k / 256 * 110] (q in -4..3, signed 6-bit scales)."""
    rows, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=2) / 3.5
    d = (scale.max(axis=1) / 31.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-32, 31)
        ds = d[:, None] * sc
        q = np.where(ds[..., None] != 0, np.rint(x / ds[..., None]), 0).clip(-4, 3).astype(np.int16) + 4
    q = q.reshape(-1, 256).astype(np.uint8)  # 0..7: bit 2 the high bit
    hi = (q >> 2).reshape(-1, 8, 32)  # element 32 j + i: bit j of hmask[i]
    hmask = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        hmask |= hi[:, j] << j
    lo = (q & 3).reshape(-1, 2, 4, 32)  # element 128 h + 32 s + i: bits 2s of qs[32 h + i]
    qs = (lo[:, :, 0] | lo[:, :, 1] << 2 | lo[:, :, 2] << 4 | lo[:, :, 3] << 6).reshape(-1, 64)
    s6 = (sc.astype(np.int16) + 32).astype(np.uint8)  # [n, 16]
    scales = np.zeros((q.shape[0], 12), np.uint8)
    scales[:, :8] = (s6[:, :8] & 15) | (s6[:, 8:] & 15) << 4
    for k4 in range(4):
        scales[:, 8 + k4] = (
            (s6[:, k4] >> 4) | (s6[:, 4 + k4] >> 4) << 2 | (s6[:, 8 + k4] >> 4) << 4 | (s6[:, 12 + k4] >> 4) << 6
        )
    return np.concatenate([hmask, qs, scales, _half(d)], axis=1).reshape(rows, k // 256 * 110)


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, layers: int, tied: bool) -> str:
    """llama.cpp's Q4_K_M type for a 2-D tensor, with its fallback for rows of partial super-blocks."""
    m = re.match(r"blk\.(\d+)\.(\w+)\.weight", name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = "Q6_K"
    elif m and m.group(2) in ("attn_v", "ffn_down") and use_more_bits(int(m.group(1)), layers):
        t = "Q6_K"
    else:
        t = "Q4_K"
    if cols % 256:
        t = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[t]
    return t


def convert(src: str, dst: str) -> dict[str, int]:
    import gguf
    from gguf.quants import dequantize, quantize

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    layers = int(r.fields[f"{arch}.block_count"].contents())
    tied = not any(t.name == "output.weight" for t in r.tensors)
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = 15 if name == "general.file_type" else f.contents()  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        w.add_key_value(name, val, f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    counts: dict[str, int] = {}
    for t in r.tensors:
        shape = [int(v) for v in reversed(t.shape)]
        if len(shape) != 2:
            w.add_tensor(t.name, t.data, raw_shape=shape, raw_dtype=t.tensor_type)
            continue
        x = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        qt = q4_k_m_type(t.name, shape[1], layers, tied)
        counts[qt] = counts.get(qt, 0) + 1
        enc = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(qt)
        data = enc(x) if enc else quantize(x, gguf.GGMLQuantizationType[qt])
        w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args()
    print(convert(a.src, a.dst))


if __name__ == "__main__":
    main()
