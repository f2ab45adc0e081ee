"""One Python wrapper per kernel in engine/cu/*.cu.

Each ``.cu`` file is compiled once per set of compile-time constants
(``functools.cache`` around ``SourceModule(..., no_extern_c=True)``), with
``common.cuh`` prepended so PyCUDA's on-disk cache key covers it. The cache
lives in ``PYCUDA_CACHE_DIR`` (default: ``<models dir>/.cache/pycuda``).
Launches go through ``prepare()`` / ``prepared_async_call()`` on the caller's
(non-default) stream, so a sequence of them can be captured into a CUDA graph.
Pointers are plain ints (device addresses); scalars are numpy types.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

CU_DIR = Path(__file__).resolve().parent
ARCH = "sm_90"
GEMV_MAX_ROWS = 8
GEMM_SMEM = 3 * (128 + 128) * 40 * 2  # STAGES * (BM + BN) * LDS * sizeof(bf16)
DECODE_SPLITS = 32
MAX_COUNTERS = 8192  # decode attention (lane, KV head) pairs
PF_BLOCKS = 16  # rmsnorm's L2-prefetch blocks

_i32, _f32, _i64 = np.int32, np.float32, np.int64
# gemv_tc: x W bias out M N K ldo mode | ss_in ss_nparts eps nw xw ss_out | rope: positions slots inv_freq
# cache H KVH D block_size block_stride
TC_ARGS = "PPPPiiiii" + "PifPPP" + "PPPPiiiiq"
_NO_NORM = (0, _i32(0), _f32(0.0), 0, 0, 0)
_NO_ROPE = (0, 0, 0, 0, _i32(0), _i32(0), _i32(0), _i32(0), _i64(0))


def cache_dir() -> str:
    d = os.environ.get("PYCUDA_CACHE_DIR")
    if not d:
        models = os.environ.get("IGNIS_MODELS_DIR", str(CU_DIR.parent.parent / "models"))
        d = os.path.join(models, ".cache", "pycuda")
    os.makedirs(d, exist_ok=True)
    return d


@functools.cache
def module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """Compile ``engine/cu/<name>.cu`` (once per process and set of ``defines``)."""
    from pycuda.compiler import SourceModule

    src = (CU_DIR / "common.cuh").read_text() + "\n" + (CU_DIR / f"{name}.cu").read_text()
    options = ["-O3", "-std=c++17"] + [f"-D{k}={v}" for k, v in defines]
    return SourceModule(src, options=options, no_extern_c=True, arch=ARCH, cache_dir=cache_dir())


def _fn(mod, name: str, arg_types: str):
    f = mod.get_function(name)
    f.prepare(arg_types)
    return f


class Kernels:
    """Every kernel a model of this head size and grouping needs, compiled and prepared."""

    def __init__(self, head_dim: int, group: int) -> None:
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim {head_dim} not supported (64 or 128)")
        if not 1 <= group <= 8:
            raise ValueError(f"query heads per KV head {group} not supported (1..8)")
        import pycuda.driver as cuda

        self.head_dim, self.group = head_dim, group
        attn = (("HEAD_DIM", head_dim), ("GROUP", group))
        self._embed = _fn(module("embed"), "embed", "PPPiPPP")
        norm = module("norm")
        self._rmsnorm = _fn(norm, "rmsnorm", "PPPiifiPq")
        self._swiglu = _fn(norm, "swiglu", "PPiii")
        self._rope = _fn(module("rope"), "rope_kv_write", "PPPPPPiiiiqiPqi")
        gemv = module("gemv")
        self._gemv = {m: _fn(gemv, f"gemv_m{m}", "PPPPiiii") for m in range(1, GEMV_MAX_ROWS + 1)}
        self._gemv_tc = _fn(gemv, "gemv_tc", TC_ARGS)
        self._gemv_tc_u2 = _fn(gemv, "gemv_tc_u2", TC_ARGS)
        # Products of up to 8 rows run on the tensor cores (gemv_tc) at every width, so a lane's
        # arithmetic (and its tokens) do not depend on its round's width; the fused decode round
        # (RMSNorm, rope, SwiGLU in GEMV epilogues) exists only there. fma_min_elems sends
        # width-1 products of at least that many weights to the FMA kernel instead (it streams
        # gate|up at 96% vs 85% of read bandwidth alone, but drifts with width; unfused path
        # only, off by default). tc_from routes narrower widths to the FMA kernel (benchmarks and
        # tests). Matrices under u2_below weights (q|k|v and o on the 8B shape) use the 2-step
        # gemv_tc variant, 4 blocks an SM: 0.04 ms less a fused round on the H200 (docs/PERFORMANCE.md).
        self.tc_from = int(os.environ.get("IGNIS_CUDA_TC_FROM", "1"))
        self.fma_min_elems = int(os.environ.get("IGNIS_CUDA_FMA_MIN_ELEMS", str(1 << 62)))
        self.u2_below = int(os.environ.get("IGNIS_CUDA_GEMV_U2_BELOW", str(40 << 20)))
        self._gemm = _fn(module("gemm"), "gemm_bf16", "PPPPiiiii")
        self._gemm.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, GEMM_SMEM)
        dec = module("attention_decode", attn + (("NUM_SPLITS", DECODE_SPLITS),))
        self._decode_attn = _fn(dec, "decode_attn", "PPPiPqiifPPPP")
        self._decode_combine = _fn(dec, "decode_combine", "PPPP")
        self._prefill_attn = _fn(module("attention_prefill", attn), "prefill_attn", "PPPqiiiifP")
        self._counters = cuda.mem_alloc(4 * MAX_COUNTERS)  # decode_attn's split counters, self-resetting
        cuda.memset_d32(self._counters, 0, MAX_COUNTERS)
        samp = module("sample")
        self._penalties = _fn(samp, "apply_penalties", "PiPPPPi")
        self._sample = _fn(samp, "sample", "PiPPPP")

    # --- elementwise ---------------------------------------------------------------------

    def embed(self, s, tokens: int, table: int, x: int, rows: int, hidden: int,
              norm_out: tuple[int, int, int] = (0, 0, 0)) -> int:  # fmt: skip
        """``norm_out`` = (norm weight, xw, ss_out): also write the first RMSNorm's inputs for the
        fused decode GEMV (gemv.cu); returns the number of ss partials per row (1)."""
        nw, xw, ss = norm_out
        self._embed.prepared_async_call((rows, 1, 1), (128, 1, 1), s, tokens, table, x, _i32(hidden), nw, xw, ss)
        return 1

    def rmsnorm(self, s, x: int, w: int, out: int, rows: int, hidden: int, eps: float, x_stride: int | None = None,
                prefetch: tuple[int, int] = (0, 0)):  # fmt: skip
        """``prefetch`` = (pointer, bytes): ask L2 to start fetching them (the next GEMV's weights)."""
        stride = hidden if x_stride is None else x_stride
        pf, nb = prefetch
        grid = rows + (PF_BLOCKS if nb > 0 else 0)
        self._rmsnorm.prepared_async_call(
            (grid, 1, 1), (256, 1, 1), s, x, w, out, _i32(hidden), _i32(stride), _f32(eps), _i32(rows), pf, _i64(nb)
        )

    def swiglu(self, s, gu: int, out: int, inter: int, rows: int, interleaved: bool = False) -> None:
        blocks = max(1, min(4096, (rows * inter + 255) // 256))
        self._swiglu.prepared_async_call(
            (blocks, 1, 1), (256, 1, 1), s, gu, out, _i32(inter), _i32(rows), _i32(interleaved)
        )

    def rope_kv_write(
        self, s, qkv, positions, slots, inv_freq, q_out, cache, rows, heads, kv_heads, block_size, block_stride,
        prefetch: tuple[int, int] = (0, 0), interleaved: bool = False,
    ) -> None:  # fmt: skip
        """``interleaved``: qkv's heads are in the rope-interleaved row order (``interleave_rope``)."""
        pf, nb = prefetch
        self._rope.prepared_async_call(
            (rows + (1 if nb > 0 else 0), heads + kv_heads, 1), (self.head_dim // 2, 1, 1), s, qkv, positions, slots,
            inv_freq, q_out, cache, _i32(heads), _i32(kv_heads), _i32(self.head_dim), _i32(block_size),
            _i64(block_stride), _i32(rows), pf, _i64(nb), _i32(interleaved),
        )  # fmt: skip

    # --- matrix products -----------------------------------------------------------------

    def linear(
        self,
        s,
        x: int,
        w: int,
        bias: int,
        out: int,
        rows: int,
        n: int,
        k: int,
        ldo: int | None = None,
        accumulate: bool = False,
        ss_in: tuple[int, int] = (0, 0),
        eps: float = 0.0,
        norm_out: tuple[int, int, int] = (0, 0, 0),
    ) -> int:
        """out[rows, n] (+)= x[rows, k] @ w[n, k].T (+ bias): GEMV up to 8 rows, tensor cores above.

        Fused RMSNorm (gemv_tc only, rows <= 8; gemv.cu): ``ss_in`` = (partials, count per row)
        scales each row by rsqrt(sum / k + eps) (x then holds bf16(h * norm weight)); ``norm_out``
        = (norm weight, xw, ss_out) writes the next norm's inputs from the new out. Returns the
        number of ss partials per row written (ceil(n / 16)) or 0."""
        if k % 8:
            raise ValueError(f"K={k} must be a multiple of 8")
        ldo = n if ldo is None else ldo
        fused = bool(ss_in[0] or norm_out[0])
        if fused and not 1 <= rows <= GEMV_MAX_ROWS:
            raise ValueError(f"fused RMSNorm needs 1..{GEMV_MAX_ROWS} rows, got {rows}")
        if norm_out[0] and ldo != n:
            raise ValueError("norm_out needs a contiguous output (ldo == n)")
        use_tc = fused or (self.tc_from <= rows <= GEMV_MAX_ROWS and not (rows == 1 and n * k >= self.fma_min_elems))
        if use_tc:
            norm = (ss_in[0], _i32(ss_in[1]), _f32(eps), *norm_out)
            self._tc(s, x, w, bias, out, rows, n, k, ldo, int(accumulate), norm)
            return (n + 15) // 16 if norm_out[0] else 0
        elif rows <= GEMV_MAX_ROWS:
            self._gemv[rows].prepared_async_call(
                ((n + 3) // 4, 1, 1), (256, 1, 1), s, x, w, bias, out, _i32(n), _i32(k), _i32(ldo), _i32(accumulate)
            )
        else:
            self._gemm.prepared_async_call(
                ((rows + 127) // 128, (n + 127) // 128, 1), (256, 1, 1), s, x, w, bias, out,
                _i32(rows), _i32(n), _i32(k), _i32(ldo), _i32(accumulate), shared_size=GEMM_SMEM,
            )  # fmt: skip
        return 0

    def _tc(self, s, x, w, bias, out, rows, n, k, ldo, mode, norm=_NO_NORM, rope=_NO_ROPE) -> None:
        fn = self._gemv_tc_u2 if n * k < self.u2_below else self._gemv_tc
        fn.prepared_async_call(
            ((n + 15) // 16, 1, 1), (256, 1, 1), s, x, w, bias, out, _i32(rows), _i32(n), _i32(k), _i32(ldo),
            _i32(mode), *norm, *rope,
        )  # fmt: skip

    def qkv_rope(
        self, s, x, w, bias, q_out, rows, heads, kv_heads, k, positions, slots, inv_freq, cache, block_size,
        block_stride, ss_in: tuple[int, int] = (0, 0), eps: float = 0.0,
    ) -> None:  # fmt: skip
        """The q|k|v GEMV (``w`` rope-interleaved per head, ``interleave_rope``) with rope and the KV
        write in its epilogue (gemv_tc mode 3): q_out bf16 [rows, heads, D] rotated, K rotated and V
        copied into their cache slots, as ``rope_kv_write`` does. ``ss_in``: fused RMSNorm as in
        ``linear``."""
        if not 1 <= rows <= GEMV_MAX_ROWS or k % 8:
            raise ValueError(f"qkv_rope needs 1..{GEMV_MAX_ROWS} rows and K % 8 == 0 (rows={rows}, K={k})")
        d = self.head_dim
        n = (heads + 2 * kv_heads) * d
        norm = (ss_in[0], _i32(ss_in[1]), _f32(eps), 0, 0, 0)
        rope = (positions, slots, inv_freq, cache, _i32(heads), _i32(kv_heads), _i32(d), _i32(block_size),
                _i64(block_stride))  # fmt: skip
        self._tc(s, x, w, bias, q_out, rows, n, k, heads * d, 3, norm, rope)

    def gate_up_act(self, s, x: int, w: int, gu: int, act: int, rows: int, inter: int, k: int,
                    ss_in: tuple[int, int] = (0, 0), eps: float = 0.0) -> None:  # fmt: skip
        """act[rows, inter] = bf16(silu(gate) * up) of x @ w.T, ``w`` the gate|up matrix interleaved in
        8-row groups (``interleave_gate_up``). Up to 8 rows the SwiGLU is the GEMV's epilogue (no fp32
        ``gu`` round trip, one launch); wider, the GEMM writes ``gu`` and ``swiglu`` reads it."""
        if k % 8 or inter % 8:
            raise ValueError(f"K={k} and I={inter} must be multiples of 8")
        if ss_in[0] or self.tc_from <= rows <= GEMV_MAX_ROWS:
            if not 1 <= rows <= GEMV_MAX_ROWS:
                raise ValueError(f"fused RMSNorm needs 1..{GEMV_MAX_ROWS} rows, got {rows}")
            self._tc(s, x, w, 0, act, rows, 2 * inter, k, inter, 2, (ss_in[0], _i32(ss_in[1]), _f32(eps), 0, 0, 0))
        else:
            self.linear(s, x, w, 0, gu, rows, 2 * inter, k)
            self.swiglu(s, gu, act, inter, rows, interleaved=True)

    # --- attention -----------------------------------------------------------------------

    def decode_attention(
        self, s, q, positions, block_tables, bt_stride, cache, block_stride, block_size, kv_heads, o_part, ml, out, rows
    ) -> None:
        """Split-K decode attention; the splits are merged inside the same kernel (last block per lane
        and KV head), so this is one launch."""
        if rows * kv_heads > MAX_COUNTERS:
            raise ValueError(f"{rows} rows x {kv_heads} KV heads exceeds {MAX_COUNTERS} split counters")
        scale = _f32(self.head_dim**-0.5 * np.log2(np.e))
        self._decode_attn.prepared_async_call(
            (kv_heads, rows, DECODE_SPLITS), (128, 1, 1), s, q, positions, block_tables, _i32(bt_stride), cache,
            _i64(block_stride), _i32(block_size), _i32(kv_heads), scale, o_part, ml, self._counters, out,
        )  # fmt: skip

    def prefill_attention(self, s, q, block_table, cache, block_stride, block_size, kv_heads, n, start, out) -> None:
        scale = _f32(self.head_dim**-0.5 * np.log2(np.e))
        self._prefill_attn.prepared_async_call(
            ((n + 63) // 64, kv_heads * self.group, 1), (128, 1, 1), s, q, block_table, cache, _i64(block_stride),
            _i32(block_size), _i32(kv_heads), _i32(n), _i32(start), scale, out,
        )  # fmt: skip

    # --- sampling ------------------------------------------------------------------------

    def penalties(self, s, logits, vocab, params, pen_tokens, pen_counts, pen_num, pen_stride, rows) -> None:
        self._penalties.prepared_async_call(
            (rows, 1, 1), (256, 1, 1), s, logits, _i32(vocab), params, pen_tokens, pen_counts, pen_num,
            _i32(pen_stride),
        )  # fmt: skip

    def sample(self, s, logits, vocab, params, seeds, positions, out_tokens, rows) -> None:
        self._sample.prepared_async_call(
            (rows, 1, 1), (1024, 1, 1), s, logits, _i32(vocab), params, seeds, positions, out_tokens
        )


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[I, K] gate and up -> [2I, K] in 8-row groups (gate 8j..8j+7, then up 8j..8j+7), the layout
    ``gate_up_act`` and ``swiglu(interleaved=True)`` read. Works on numpy arrays and torch tensors."""
    i, k = gate.shape
    if type(gate).__module__.startswith("torch"):
        import torch

        return torch.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)
    return np.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)


def interleave_rope(w, head_dim: int):
    """Rows (dim 0) of ``heads`` stacked heads of ``head_dim`` -> each head in the rope-interleaved
    order gemv_tc mode 3 and ``rope_kv_write(interleaved=True)`` read: position 16j + r holds dim
    8j + r, position 16j + 8 + r dim head_dim/2 + 8j + r. Works on numpy arrays and torch tensors
    (weights [rows, K] or biases [rows])."""
    n, rest = w.shape[0], tuple(w.shape[1:])
    if head_dim % 16 or n % head_dim:
        raise ValueError(f"{n} rows are not whole heads of {head_dim} (a multiple of 16)")
    v = w.reshape((n // head_dim, 2, head_dim // 16, 8) + rest)
    return (v.transpose(1, 2) if type(w).__module__.startswith("torch") else v.swapaxes(1, 2)).reshape(w.shape)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
