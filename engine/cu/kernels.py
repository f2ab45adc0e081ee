"""One Python wrapper per kernel in engine/cu/*.cu.

Every kernel is declared once, in ``Kernels.__init__``: its source, compile-time
constants, block size and parameter list (``engine.cu.launch.Kernel``); the
wrappers below compute grids, check preconditions and pass parameters by name.
A weight matrix is a device pointer (bf16) or an ``engine.cu.quant.Matrix`` (parts in
GGUF block formats, read as stored by gemv_q.cu in decode rounds; dequantized into
``scratch`` for the prefill GEMM).
Block sizes that a source depends on reach it as a define from the same
constant (``TC_THREADS``, ``GEMM_THREADS``, ``DECODE_THREADS``,
``PREFILL_THREADS``, ``SAMPLE_THREADS``), and so does the greedy floor
(``MIN_TEMPERATURE``, engine/sampling.py's). Pointers are plain ints (device
addresses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cu.hopper import BLOCK, PER_CHANNEL, GemmRoute, HopperGemm, route_attention, route_gemm
from engine.cu.launch import Kernel, module, pdl_module
from engine.cu.quant import (
    BF16,
    FP8,
    FP8_BLOCK,
    FP8B,
    QACT8_FORMATS,
    QACT_THREADS,
    QF8_THREADS,
    Matrix,
    QuantKernels,
    quant_act_bytes,
)
from engine.sampling import MIN_TEMPERATURE

GEMV_MAX_ROWS = 64  # gemv.cu's bf16 GEMV (its epilogues and fused norms included)
QUANT_GEMV_MAX_ROWS = 8  # gemv_q.cu's (GGUF blocks, fp8): one group of 8 activation rows
# gemv.cu's variants by rows: (most rows, suffix); 1..8 rows pick "" or "_u2" by the matrix's size.
GEMV_ROW_VARIANTS = ((16, "_r16"), (32, "_r32"), (64, "_r64"))
# Steps in flight per warp and blocks per SM of the wider variants (their activation fragments
# take the registers: 102 / 128 / 124 a thread, no spills, ptxas on sm_90a).
GEMV_ROW_TUNING = (("R16_U", 2), ("R16_MINB", 2), ("R32_U", 2), ("R32_MINB", 2), ("R64_U", 1), ("R64_MINB", 2))
# gemv_wide.cu (x read once a block of 128 weight rows, gemv_tc's bits): rounds of 9..64 rows on a
# matrix of at least ``wide_min_n`` rows; its variants by groups of 8 x rows, and their stages.
WIDE_GROUPS = (2, 4, 8)
WIDE_STAGES = 4
WIDE_ROWS = 128  # weight rows a block
# gemv_pair.cu's paired wide variants (``Kernels(gemv_pair=True)``): steps in flight a warp, by
# the variant's groups of 8 x rows (their x buffers take 16 KB x U x G of shared memory a block).
PAIR_TUNING = (("P16_U", 2), ("P32_U", 2), ("P64_U", 1))
PAIR_THREADS = 2 * 256
# The paired variants take GEMVs of this many rows up (``Kernels(pair_from=)``): on an H100 (2026-12-07,
# docs/PERFORMANCE.md) the 64-row variant made the rounds of 36..64 rows 6-9% faster, and the 16- and
# 32-row ones made the rounds of 9..32 rows 2-13% slower than gemv_tc's own.
PAIR_FROM = 33
# cuda.fp8_gemm: chunks of up to this many rows take gemm_hopper_fp8b for an FP8B matrix; wider ones the
# dequant + bf16 GEMM, which was faster there on an H100 (docs/PERFORMANCE.md, "FP8 prefill on the
# tensor cores": 0.45-0.96x its time at 128 rows, 0.85-1.09x at 512, 1.1-1.6x slower from 1,024).
FP8B_TC_MAX_ROWS = 384


def pair_smem(groups: int, tuning=PAIR_TUNING) -> int:
    """Dynamic shared memory of gemv_pair.cu's variant of ``groups`` groups: 8 warp pairs x 2 buffers x
    U steps x 2 halves x 8 ``groups`` rows x 4 chunks of 16 bytes."""
    u = dict(tuning)[f"P{8 * groups}_U"]
    return 8 * 2 * u * 2 * groups * 32 * 16


def pair_fits(cuda) -> bool:
    """Whether the current device gives a block the paired variants' shared memory (128 KB: Hopper and
    the A100 do, most other cards stop near 100 KB; without them the wide GEMVs stay gemv_tc's)."""
    attr = getattr(cuda.device_attribute, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", None)
    need = max(pair_smem(most // 8) for most, _ in GEMV_ROW_VARIANTS)
    return attr is None or cuda.Context.get_device().get_attribute(attr) >= need


def wide_smem(groups: int) -> int:
    """gemv_wide.cu's dynamic shared memory: WIDE_STAGES x (128 W rows + 8 ``groups`` x rows) x 128 bytes."""
    return WIDE_STAGES * (WIDE_ROWS + 8 * groups) * 128


GEMM_SMEM = 3 * (128 + 128) * 40 * 2  # STAGES * (BM + BN) * LDS * sizeof(bf16)
DECODE_SPLITS = 32
# ``Kernels(decode_lanes=True)``: rounds of more rows than this run attention_decode.cu's DECODE_LR build
# (a lane's verify rows share their blocks; the plain build keeps narrower rounds, at fewer registers).
DECODE_LANES_FROM = 9
MAX_COUNTERS = 8192  # decode attention (lane, KV head) pairs
PF_BLOCKS = 16  # rmsnorm's L2-prefetch blocks

TC_THREADS, GEMM_THREADS, DECODE_THREADS, PREFILL_THREADS, SAMPLE_THREADS = 256, 256, 128, 128, 1024
# Sources whose kernels wait for the kernel before them (common.cuh pdl_wait): with pdl, a decode
# round's every launch but a quantized GEMV's (gemv_q.cu, launched as without pdl).
PDL_SOURCES = frozenset({"embed", "norm", "rope", "gemv", "attention_decode", "sample"})

# gemv_tc's epilogues, one compiled entry point each (and a 2-step "_u2" variant of each).
STORE, ACC, SWIGLU, GEGLU, ROPE_KV = "store", "acc", "swiglu", "geglu", "rope"
GATE_EPILOGUE = {"silu": SWIGLU, "gelu_tanh": GEGLU}  # GatedMLP.act -> its gemv_tc epilogue
ACT_CODE = {"silu": 0, "gelu_tanh": 1}  # GatedMLP.act -> norm.cu swiglu's act
LOG2E = float(np.log2(np.e))
_TC_HEAD = "x:ptr W:ptr bias:ptr out:ptr M:i32 N:i32 K:i32 ldo:i32 ss_in:ptr ss_nparts:i32 eps:f32"
TC_PARAMS = {
    STORE: _TC_HEAD + " nw:ptr xw:ptr ss_out:ptr",
    ACC: _TC_HEAD + " nw:ptr xw:ptr ss_out:ptr",
    SWIGLU: _TC_HEAD.replace(" bias:ptr", ""),
    GEGLU: _TC_HEAD.replace(" bias:ptr", ""),
    ROPE_KV: _TC_HEAD + " positions:ptr slots:ptr inv_freq:ptr cache:ptr H:i32 KVH:i32 D:i32 block_size:i32"
    " block_stride:i64 rotary_dim:i32 rope_factor:f32",
}


def attention_scales(head_dim: int, scale: float | None, softcap: float | None) -> tuple[np.float32, np.float32]:
    """``(scale_log2, cap_log2)`` the attention kernels take: the score is q.k * scale_log2 in base 2,
    or with a soft-cap cap_log2 * tanh(q.k * scale_log2) (scale_log2 then scale / cap)."""
    scale = head_dim**-0.5 if scale is None else scale
    if softcap:
        return np.float32(scale / softcap), np.float32(softcap * LOG2E)
    return np.float32(scale * np.log2(np.e)), np.float32(0.0)


def gemv_rows(w) -> int:
    """The most rows a decode GEMV takes with weight ``w``: gemv.cu's 64 for bf16, gemv_q.cu's 8 for a
    matrix with a part in a block format (or fp8)."""
    if isinstance(w, Matrix) and w.formats != (BF16,):
        return QUANT_GEMV_MAX_ROWS
    return GEMV_MAX_ROWS


@dataclass(frozen=True)
class AttnArgs:
    """One layer's attention options as the kernels take them (``engine.models.ops.Attention``)."""

    scale_log2: np.float32
    cap_log2: np.float32 = np.float32(0.0)  # > 0: soft-capped scores
    window: int = 0  # > 0: sliding window
    sinks: int = 0  # fp32 [heads] or 0


class Kernels:
    """Every kernel a model of this head size and grouping needs, compiled and prepared.

    ``u2_below``: matrices of fewer weights use gemv_tc's 2-step variant (4 blocks an SM;
    q|k|v and o on the 8B shape: 0.02-0.04 ms less a round on the H200, docs/PERFORMANCE.md).
    ``cache_dir``: PyCUDA's kernel cache ("" = the default, ``launch.DEFAULT_CACHE_DIR``).
    ``formats``: the GGUF block formats of the model's matrices (gemv_q.cu compiled for each now;
    ``quant(fmt)`` compiles any other when first asked). ``scratch`` (set by the backend): a bf16
    buffer as large as the largest quantized matrix, where prefill dequantizes it for the GEMM.
    ``pdl`` (``cuda.pdl``): the kernels of ``PDL_SOURCES`` compiled with ``PDL=1`` and launched with
    programmatic dependent launch (engine/cu/launch.py, docs/CUDA.md); the others as without it.
    ``wide_min_n`` (``CudaTuning.gemv_wide_min_n``): a bf16 GEMV of 9..64 rows on a matrix of at least
    this many rows runs gemv_wide.cu (the same bits as gemv_tc, x read once a 128-row block); 0: never
    (the module is not compiled).
    ``quant_act`` (``cuda.quant_activations``): a decode GEMV over a matrix with a part in a GGUF block
    format quantizes x to int8 (quant_act.cu) into ``qact`` (set by the backend: ``qact_bytes`` =
    ``quant.quant_act_bytes`` of the largest K, allocated before any graph capture) once a call, and
    those parts run gemv_q.cu's int8 main loop (QACT8); FP8 and bf16 parts keep bf16 x.
    ``quant_persist`` (``CudaTuning.quant_persist``): the quantized GEMVs launch at most the blocks that
    are resident at once, each walking 16-row tiles with its stage pipeline running on between them
    (``QuantKernels.grid``; the same bits).
    ``gemv_pair`` (``CudaTuning.gemv_pair``): a bf16 GEMV of ``pair_from``..64 rows runs gemv_pair.cu's
    variants (blocks of two 16-row tiles sharing x through shared memory; gemv_tc's bits), unless
    gemv_wide takes it.
    ``decode_lanes`` (``CudaTuning.decode_lanes``): decode attention of a round of ``DECODE_LANES_FROM`` rows
    or more runs the DECODE_LR build, whose blocks take a lane's verify rows together (up to 16 / group
    of them; the same bits); head_dim 64 / 128 only (256: the plain build).
    ``fp8_gemm`` (``CudaTuning.fp8_gemm``): on an sm_90 device, the prefill GEMM of a matrix whose parts
    are all ``FP8`` (per-channel scales) runs on the fp8 tensor cores (gemm_hopper_fp8) with x
    quantized to e4m3 a row at a time (quant_act.cu's quant_act_fp8, into ``scratch``) instead of
    dequantizing the weights into ``scratch`` for the bf16 GEMM (``fp8_prefill``); all ``FP8B``
    (128 x 128 tiles): gemm_hopper_fp8b with x quantized a row and 128-wide block (quant_act_fp8_g128).
    ``narrow_tiles`` (``CudaTuning.narrow_tiles``): gemm_hopper may take its 64- and 32-column tiles for a
    GEMM of up to 128 rows (``hopper.pick``; the same bits).
    """

    def __init__(self, head_dim: int, group: int, *, u2_below: int = 40 << 20, cache_dir: str = "",
                 formats=(), pdl: bool = False, wide_min_n: int = 0, quant_act: bool = False,
                 quant_persist: bool = False, gemv_pair: bool = False, pair_from: int = PAIR_FROM,
                 decode_lanes: bool = False, fp8_gemm: bool = False, narrow_tiles: bool = True) -> None:  # fmt: skip
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim} not supported (64, 128 or 256)")
        if not 1 <= group <= 8:
            raise ValueError(f"query heads per KV head {group} not supported (1..8)")
        import pycuda.driver as cuda

        self.head_dim, self.group, self.u2_below, self.pdl = head_dim, group, u2_below, pdl
        self.wide_min_n, self.quant_persist = wide_min_n, quant_persist
        # Rows up to which linear / gate_up_act take the GEMV (beyond: the GEMM). The backend sets it
        # to its widest decode round while it captures the graphs, then to a plain round's rows
        # (cuda.round_rows) for the prefill passes: a prefill chunk of more rows than a round holds
        # runs the GEMM, which a wide GEMV variant is slower than (docs/SPECULATION.md).
        self.gemv_cap = GEMV_MAX_ROWS
        self.cache_dir, self._quant, self.scratch, self.scratch_bytes = cache_dir, {}, 0, 0
        self.quant_act, self._quant8, self.qact, self.qact_bytes = quant_act, {}, 0, 0
        for fmt in formats:
            if fmt != BF16:
                self.quant(fmt)
                if quant_act and fmt in QACT8_FORMATS:
                    self.quant8(fmt)
        if quant_act:
            self._quant_act = Kernel(module("quant_act", (), cache_dir), "quant_act_q8", "x:ptr q:ptr M:i32 K:i32",
                                     QACT_THREADS)  # fmt: skip

        def mod(name: str, *defines: tuple[str, int]):
            if pdl and name in PDL_SOURCES:
                return pdl_module(name, tuple(defines), cache_dir)
            return module(name, tuple(defines), cache_dir)

        attn = (("HEAD_DIM", head_dim), ("GROUP", group))
        self._embed = Kernel(mod("embed"), "embed", "tokens:ptr table:ptr x:ptr H:i32 nw:ptr xw:ptr ss_out:ptr "
                             "scale:f32 src_rows:ptr prev:ptr", 128)  # fmt: skip
        norm = mod("norm")
        self._rmsnorm = Kernel(norm, "rmsnorm", "x:ptr w:ptr out:ptr H:i32 x_stride:i32 eps:f32 rows:i32 pf:ptr "
                               "pf_bytes:i64", 256)  # fmt: skip
        self._swiglu = Kernel(norm, "swiglu", "gu:ptr out:ptr I:i32 rows:i32 interleaved:i32 act:i32", 256)
        self._add_rmsnorm = Kernel(norm, "add_rmsnorm", "y:ptr w:ptr x:ptr H:i32 eps:f32 nw:ptr xw:ptr ss_out:ptr", 256)
        self._softcap = Kernel(norm, "softcap", "x:ptr n:i64 cap:f32", 256)
        self._rope = Kernel(mod("rope"), "rope_kv_write", "qkv:ptr positions:ptr slots:ptr inv_freq:ptr q_out:ptr "
                            "cache:ptr H:i32 KVH:i32 D:i32 block_size:i32 block_stride:i64 rows:i32 pf:ptr "
                            "pf_bytes:i64 interleaved:i32 rotary_dim:i32 factor:f32 q_norm:ptr k_norm:ptr eps:f32 "
                            "mrope1:i32 mrope2:i32",
                            head_dim // 2)  # fmt: skip
        gemv = mod("gemv", ("TC_THREADS", TC_THREADS), *GEMV_ROW_TUNING)
        self._tc = {  # 1..8 rows, keyed (epilogue, u2)
            (epi, u2): Kernel(gemv, f"gemv_tc_{epi}" + ("_u2" if u2 else ""), params, TC_THREADS)
            for epi, params in TC_PARAMS.items()
            for u2 in (False, True)
        }
        self._tc_wide = {  # 9..64 rows, keyed (epilogue, most rows)
            (epi, most): Kernel(gemv, f"gemv_tc_{epi}{sfx}", params, TC_THREADS)
            for epi, params in TC_PARAMS.items()
            for most, sfx in GEMV_ROW_VARIANTS
        }
        self._tcp = {}  # gemv_pair: pair_from..64 rows, keyed (epilogue, most rows)
        self.pair_from = pair_from
        if gemv_pair and pair_fits(cuda):  # launched as without pdl (its dynamic shared memory is set through PyCUDA)
            paired = module("gemv_pair", (("TC_THREADS", TC_THREADS), ("GEMV_EPILOGUES_ONLY", 1), ("GEMV_PAIR", 1),
                                          *PAIR_TUNING), cache_dir, ("gemv",))  # fmt: skip
            for epi, params in TC_PARAMS.items():
                for most, sfx in GEMV_ROW_VARIANTS:
                    if most < pair_from:  # a round of pair_from rows up never picks it
                        continue
                    kp = Kernel(paired, f"gemv_tc_{epi}{sfx}p", params, PAIR_THREADS, shared=pair_smem(most // 8))
                    kp.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, pair_smem(most // 8))
                    self._tcp[(epi, most)] = kp
        self._tcw = {}  # 9..64 rows on large matrices, keyed (epilogue, groups of 8 rows)
        if wide_min_n > 0:
            wide = module("gemv_wide", (("TC_THREADS", TC_THREADS), ("GEMV_EPILOGUES_ONLY", 1),
                                        ("TCW_NS", WIDE_STAGES)), cache_dir, ("gemv",))  # fmt: skip
            for epi, params in TC_PARAMS.items():
                for groups in WIDE_GROUPS:
                    kw = Kernel(wide, f"gemv_tcw_{epi}_g{groups}", params, TC_THREADS, shared=wide_smem(groups))
                    kw.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, wide_smem(groups))
                    self._tcw[(epi, groups)] = kw
        self._gemm = Kernel(mod("gemm", ("GEMM_THREADS", GEMM_THREADS)), "gemm_bf16", "A:ptr W:ptr bias:ptr C:ptr "
                            "M:i32 N:i32 K:i32 ldc:i32 accumulate:i32", GEMM_THREADS, shared=GEMM_SMEM)  # fmt: skip
        self._gemm.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, GEMM_SMEM)
        # gemm_hopper on sm_90 (engine/cu/hopper.py); ``narrow_tiles``: with its 64 / 32-column tiles
        self._gemm = route_gemm(self._gemm, cache_dir, narrow=narrow_tiles)
        # cuda.fp8_gemm: format -> (gemm_hopper_fp8 / _fp8b, its x quantizer, scales a row of x)
        self._fp8: dict[str, tuple[HopperGemm, Kernel, int]] = {}
        if fp8_gemm and isinstance(self._gemm, GemmRoute):
            qa = module("quant_act", (), cache_dir)
            for fmt, kind, fn in ((FP8, PER_CHANNEL, "quant_act_fp8"), (FP8B, BLOCK, "quant_act_fp8_g128")):
                if fmt in formats:
                    quantizer = Kernel(qa, fn, "x:ptr q:ptr sa:ptr M:i32 K:i32", QF8_THREADS)
                    self._fp8[fmt] = (HopperGemm(cache_dir, fp8=kind), quantizer, kind)
        dec_args = (*attn, ("NUM_SPLITS", DECODE_SPLITS), ("DECODE_THREADS", DECODE_THREADS))
        dec_params = (
            "q:ptr positions:ptr block_tables:ptr bt_stride:i32 cache:ptr block_stride:i64 block_size:i32 "
            "KVH:i32 scale_log2:f32 o_part:ptr ml:ptr counters:ptr out:ptr window:i32 cap_log2:f32 sinks:ptr"
        )
        self._decode_attn = Kernel(mod("attention_decode", *dec_args), "decode_attn", dec_params, DECODE_THREADS)
        self._decode_lanes = None  # the DECODE_LR build: one block a lane's group of rows
        if decode_lanes and head_dim <= 128:
            lr = mod("attention_decode", *dec_args, ("DECODE_LR", 16 // group))
            self._decode_lanes = Kernel(lr, "decode_attn", dec_params + " lane_first:ptr", DECODE_THREADS)
        pre = mod("attention_prefill", *attn, ("PREFILL_THREADS", PREFILL_THREADS))
        self._prefill_attn = Kernel(pre, "prefill_attn", "q:ptr block_table:ptr cache:ptr block_stride:i64 "
                                    "block_size:i32 KVH:i32 n:i32 start:i32 scale_log2:f32 out:ptr window:i32 "
                                    "cap_log2:f32 sinks:ptr", PREFILL_THREADS)  # fmt: skip
        self._prefill_hopper = route_attention(head_dim, group, cache_dir)  # sm_90, head_dim 128 (hopper.py)
        self._counters = cuda.mem_alloc(4 * MAX_COUNTERS)  # decode_attn's split counters, self-resetting
        cuda.memset_d32(self._counters, 0, MAX_COUNTERS)
        samp = mod("sample", ("SAMPLE_THREADS", SAMPLE_THREADS), ("MIN_TEMPERATURE", MIN_TEMPERATURE))
        self._penalties = Kernel(samp, "apply_penalties", "logits:ptr V:i32 params:ptr pen_tokens:ptr pen_counts:ptr "
                                 "pen_num:ptr pen_stride:i32", 256)  # fmt: skip
        self._sample = Kernel(samp, "sample", "logits:ptr V:i32 params:ptr seeds:ptr positions:ptr out_tokens:ptr",
                              SAMPLE_THREADS)  # fmt: skip
        self.plain = AttnArgs(*attention_scales(head_dim, None, None)[:1])  # llama's: head_dim^-0.5, nothing else

    # --- elementwise ---------------------------------------------------------------------

    def embed(self, s, tokens: int, table: int, x: int, rows: int, hidden: int,
              norm_out: tuple[int, int, int] = (0, 0, 0), scale: float = 1.0,
              feed: tuple[int, int] = (0, 0)) -> int:  # fmt: skip
        """x = table[tokens] * scale. ``norm_out`` = (norm weight, xw, ss_out): also write the first RMSNorm's
        inputs for the fused decode GEMV (gemv.cu); returns the number of ss partials per row (1).
        ``feed`` = (src_rows, prev): a row with src_rows[row] >= 0 embeds prev[src_rows[row]] instead
        (a round planned ahead reads the tokens the round before drew on the device)."""
        nw, xw, ss = norm_out
        self._embed(s, (rows,), tokens=tokens, table=table, x=x, H=hidden, nw=nw, xw=xw, ss_out=ss, scale=scale,
                    src_rows=feed[0], prev=feed[1])  # fmt: skip
        return 1

    def add_rmsnorm(self, s, y: int, w: int, x: int, rows: int, hidden: int, eps: float,
                    norm_out: tuple[int, int, int] = (0, 0, 0)) -> int:  # fmt: skip
        """x += rmsnorm(y) * w (a post-norm before the residual add); ``norm_out`` as ``embed``'s
        (returns 1 partial per row, or 0 without it)."""
        nw, xw, ss = norm_out
        self._add_rmsnorm(s, (rows,), y=y, w=w, x=x, H=hidden, eps=eps, nw=nw, xw=xw, ss_out=ss)
        return 1 if nw else 0

    def softcap(self, s, x: int, n: int, cap: float) -> None:
        """x = cap * tanh(x / cap) in place over ``n`` fp32 values."""
        self._softcap(s, (max(1, min(1024, (n + 255) // 256)),), x=x, n=n, cap=cap)

    def rmsnorm(self, s, x: int, w: int, out: int, rows: int, hidden: int, eps: float, x_stride: int | None = None,
                prefetch: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        """``prefetch`` = (pointer, bytes): extra blocks ask L2 to start fetching them."""
        pf, nb = prefetch
        self._rmsnorm(s, (rows + (PF_BLOCKS if nb > 0 else 0),), x=x, w=w, out=out, H=hidden,
                      x_stride=hidden if x_stride is None else x_stride, eps=eps, rows=rows, pf=pf, pf_bytes=nb)  # fmt: skip

    def swiglu(self, s, gu: int, out: int, inter: int, rows: int, interleaved: bool = False, act: str = "silu") -> None:
        """act(gate) * up from fp32 gate|up; ``act`` a GatedMLP activation ("silu", "gelu_tanh")."""
        blocks = max(1, min(4096, (rows * inter + 255) // 256))
        self._swiglu(s, (blocks,), gu=gu, out=out, I=inter, rows=rows, interleaved=int(interleaved),
                     act=ACT_CODE[act])  # fmt: skip

    def rope_kv_write(self, s, qkv: int, positions: int, slots: int, inv_freq: int, q_out: int, cache: int, rows: int,
                      heads: int, kv_heads: int, block_size: int, block_stride: int,
                      prefetch: tuple[int, int] = (0, 0), interleaved: bool = False, rotary_dim: int | None = None,
                      factor: float = 1.0, qk_norm: tuple[int, int] = (0, 0), eps: float = 0.0,
                      mrope: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        """Rope on q and k of fp32 ``qkv``, K and V into their cache slots. ``interleaved``: qkv's heads
        are in the rope-interleaved row order (``weights.interleave_rope``). ``rotary_dim``: rotate
        only a head's first dims (None: all; 0: no rope); cos and sin times ``factor``. ``qk_norm`` =
        (q weight, k weight) bf16 [head_dim]: RMSNorm each q and k head first (eps). ``mrope`` =
        the cumulative pair bounds of a multimodal rope's first two runs (``positions`` then holds
        three ints a row, rope.cu); (0, 0): one position a row."""
        pf, nb = prefetch
        rd = self.head_dim if rotary_dim is None else rotary_dim
        self._rope(s, (rows + (1 if nb > 0 else 0), heads + kv_heads), qkv=qkv, positions=positions, slots=slots,
                   inv_freq=inv_freq, q_out=q_out, cache=cache, H=heads, KVH=kv_heads, D=self.head_dim,
                   block_size=block_size, block_stride=block_stride, rows=rows, pf=pf, pf_bytes=nb,
                   interleaved=int(interleaved), rotary_dim=rd, factor=factor, q_norm=qk_norm[0],
                   k_norm=qk_norm[1], eps=eps, mrope1=mrope[0], mrope2=mrope[1])  # fmt: skip

    # --- matrix products -----------------------------------------------------------------

    def linear(self, s, x: int, w: int, bias: int, out: int, rows: int, n: int, k: int, ldo: int | None = None,
               accumulate: bool = False, ss_in: tuple[int, int] = (0, 0), eps: float = 0.0,
               norm_out: tuple[int, int, int] = (0, 0, 0)) -> int:  # fmt: skip
        """out[rows, n] (+)= x[rows, k] @ w[n, k].T (+ bias): gemv_tc up to ``gemv_rows(w)`` rows (64;
        8 for a quantized matrix), the GEMM above.

        Fused RMSNorm (gemv_tc only; gemv.cu): ``ss_in`` = (partials, count per row)
        scales each row by rsqrt(sum / k + eps) (x then holds bf16(h * norm weight)); ``norm_out``
        = (norm weight, xw, ss_out) writes the next norm's inputs from the new out. Returns the
        number of ss partials per row written (ceil(n / 16)) or 0."""
        if k % 8:
            raise ValueError(f"K={k} must be a multiple of 8")
        ldo = n if ldo is None else ldo
        if norm_out[0] and ldo != n:
            raise ValueError("norm_out needs a contiguous output (ldo == n)")
        if 1 <= rows <= min(gemv_rows(w), self.gemv_cap):
            nw, xw, ss_out = norm_out
            self._gemv_tc(s, ACC if accumulate else STORE, x, w, out, rows, n, k, ldo, ss_in, eps, bias=bias, nw=nw,
                          xw=xw, ss_out=ss_out)  # fmt: skip
            return (n + 15) // 16 if norm_out[0] else 0
        if ss_in[0] or norm_out[0]:
            raise ValueError(f"fused RMSNorm needs 1..{gemv_rows(w)} rows, got {rows}")
        if self.fp8_prefill(s, x, w, bias, out, rows, n, k, ldo, accumulate):
            return 0
        self._gemm(s, ((rows + 127) // 128, (n + 127) // 128), A=x, W=self.as_bf16(s, w, n, k), bias=bias, C=out,
                   M=rows, N=n, K=k, ldc=ldo, accumulate=int(accumulate))  # fmt: skip
        return 0

    def quant(self, fmt: str) -> QuantKernels:
        """gemv_q.cu's kernels for ``fmt`` (compiled on first use)."""
        if fmt not in self._quant:
            self._quant[fmt] = QuantKernels(fmt, TC_PARAMS, self.cache_dir)
        return self._quant[fmt]

    def quant8(self, fmt: str) -> QuantKernels:
        """gemv_q.cu's int8-activation kernels (QACT8) for ``fmt`` (compiled on first use)."""
        if fmt not in self._quant8:
            self._quant8[fmt] = QuantKernels(fmt, TC_PARAMS, self.cache_dir, act8=True)
        return self._quant8[fmt]

    def quantize_act(self, s, x: int, rows: int, k: int, out: int | None = None) -> int:
        """quant_act.cu: bf16 x [rows, k] -> int8 + per-32 scales in ``out`` (default ``qact``); returns it."""
        out = self.qact if out is None else out
        if not 1 <= rows <= QUANT_GEMV_MAX_ROWS or k % 32:
            raise ValueError(f"the activation quantizer takes 1..{QUANT_GEMV_MAX_ROWS} rows, K % 32 == 0: {rows}, {k}")
        if out == self.qact and quant_act_bytes(k) > self.qact_bytes:
            raise ValueError(f"K={k} needs {quant_act_bytes(k)} bytes of the activation buffer, {self.qact_bytes} B")
        groups = rows * (k // 32)
        self._quant_act(s, (-(-groups // QACT_THREADS),), x=x, q=out, M=rows, K=k)
        return out

    def fp8_prefill(self, s, x: int, w, bias: int, out: int, rows: int, n: int, k: int, ldo: int,
                    accumulate: bool = False, act: int = -1) -> bool:  # fmt: skip
        """The GEMM of an all-``FP8`` (or all-``FP8B``) matrix ``w`` on the fp8 tensor cores (``fp8_gemm``): x
        quantized to e4m3 with a scale a row (a row and 128-wide block) into ``scratch``, then
        gemm_hopper_fp8 (_fp8b) a part, each over its columns of ``out`` (``act`` >= 0: the fused
        gate|up, one part). False (nothing launched) where it does not apply: not built, another
        format, unaligned, x does not fit the scratch, or an FP8B matrix over ``FP8B_TC_MAX_ROWS`` rows."""
        if not isinstance(w, Matrix) or len(set(w.formats)) != 1 or w.formats[0] not in self._fp8 or k % 16:
            return False  # (a q|k|v of several parts: all of one fp8 kind)
        gemm, quantizer, kind = self._fp8[w.formats[0]]
        if kind == BLOCK and rows > FP8B_TC_MAX_ROWS:
            return False  # the tile-scaled build is slower than dequant + bf16 GEMM from here (H100)
        per_row = 1 if kind == PER_CHANNEL else -(-k // FP8_BLOCK)  # x's scales a row
        q_bytes = -(-rows * k // 16) * 16
        if w.rows != n or w.k != k or q_bytes + 4 * rows * per_row > self.scratch_bytes:
            return False
        if (
            (act >= 0 and len(w.parts) > 1)
            or int(x) % 16
            or any(int(p.ptr) % 16 for p in w.parts)
            or (bias and act >= 0)
            or int(out) % (4 if act >= 0 else 8)  # gemm_hopper's stores: a bf16 pair, a float2
            or any(p.rows % 2 for p in w.parts[:-1])  # a later part's columns of out: 8-byte aligned
        ):
            return False
        q, sa, out, bias = self.scratch, self.scratch + q_bytes, int(out), int(bias)
        grid = rows if kind == PER_CHANNEL else -(-rows * per_row // (QF8_THREADS // 32))
        quantizer(s, (grid,), x=x, q=q, sa=sa, M=rows, K=k)
        r0 = 0
        for p in w.parts:
            sw = p.ptr + p.rows * k  # the part's fp32 scales follow its bytes (quant.FP8, FP8B)
            if act >= 0:
                gemm(s, q, p.ptr, 0, out, rows, p.rows, k, ldo, act=act, sa=sa, sw=sw)
            else:
                gemm(s, q, p.ptr, bias + 4 * r0 if bias else 0, out + 4 * r0, rows, p.rows, k, ldo,
                     accumulate=accumulate, sa=sa, sw=sw)  # fmt: skip
            r0 += p.rows
        return True

    def as_bf16(self, s, w, n: int, k: int) -> int:
        """A bf16 pointer to weight ``w``: itself when it is bf16, else its parts dequantized (or copied)
        into ``scratch``, row after row (valid until the next call)."""
        if not isinstance(w, Matrix):
            return w
        if w.formats == (BF16,):
            return w.ptr
        import pycuda.driver as cuda

        if w.rows != n or w.k != k or n * k * 2 > self.scratch_bytes:
            raise ValueError(f"a {w.rows} x {w.k} quantized matrix as {n} x {k}, scratch {self.scratch_bytes} B")
        off = 0
        for p in w.parts:
            if p.fmt == BF16:
                cuda.memcpy_dtod_async(self.scratch + off, p.ptr, p.rows * k * 2, s)
            else:
                self.quant(p.fmt).dequantize(s, p.ptr, self.scratch + off, p.rows, k)
            off += p.rows * k * 2
        return self.scratch

    def _gemv_tc(self, s, epi: str, x: int, w, out: int, rows: int, n: int, k: int, ldo: int,
                 ss_in: tuple[int, int], eps: float, **extra) -> None:  # fmt: skip
        """One GEMV launch per part of ``w`` (bf16: gemv.cu, a block format: gemv_q.cu), each over its
        rows: store / acc write their columns of ``out``, rope its heads (``n_base``)."""
        if isinstance(w, Matrix) and w.formats != (BF16,):
            if rows > QUANT_GEMV_MAX_ROWS:
                raise ValueError(f"the quantized GEMV takes 1..{QUANT_GEMV_MAX_ROWS} rows, got {rows}")
            if w.rows != n or w.k != k:
                raise ValueError(f"a {w.rows} x {w.k} matrix as {n} x {k}")
            if len(w.parts) > 1 and (extra.get("nw") or epi in (SWIGLU, GEGLU)):
                raise ValueError(f"the {epi} epilogue{' with norm_out' if extra.get('nw') else ''} needs one part")
            # cuda.quant_activations: x quantized once for every int8 part (a q|k|v of two formats shares it)
            act8 = self.quant_act and any(p.fmt in QACT8_FORMATS for p in w.parts)
            xq = self.quantize_act(s, x, rows, k) if act8 else 0
            r0 = 0
            for p in w.parts:
                part = dict(extra)
                if part.get("bias"):
                    part["bias"] += 4 * r0
                o = out + 4 * r0 if epi in (STORE, ACC) else out
                if p.fmt == BF16:
                    if epi == ROPE_KV and r0:
                        raise ValueError("a bf16 part after row 0 of a q|k|v matrix")
                    self._gemv_tc(s, epi, x, p.ptr, o, rows, p.rows, k, ldo, ss_in, eps, **part)
                else:
                    if epi == ROPE_KV:
                        part["n_base"] = r0
                    q8 = act8 and p.fmt in QACT8_FORMATS
                    qk = self.quant8(p.fmt) if q8 else self.quant(p.fmt)
                    qk.gemv[epi](s, qk.grid(p.rows, self.quant_persist), x=xq if q8 else x, W=p.ptr, out=o, M=rows, N=p.rows, K=k,
                                 ldo=ldo, ss_in=ss_in[0], ss_nparts=ss_in[1], eps=eps, **part)  # fmt: skip
                r0 += p.rows
            return
        if isinstance(w, Matrix):
            w = w.ptr
        if self.pdl and self.scratch and w == self.scratch:  # PDL: gemv_tc loads weights before its wait
            raise ValueError("gemv_tc with pdl reads its weights before the kernel before it ends: not scratch")
        if rows > GEMV_MAX_ROWS:
            raise ValueError(f"gemv_tc takes 1..{GEMV_MAX_ROWS} rows, got {rows}")
        block_rows = 16  # weight rows a block: gemv_tc's tile, a pair of them, gemv_wide's 8
        if rows <= 8:
            kern = self._tc[(epi, n * k < self.u2_below)]
        elif self._tcw and n >= self.wide_min_n:
            kern, block_rows = self._tcw[(epi, next(g for g in WIDE_GROUPS if rows <= 8 * g))], WIDE_ROWS
        else:
            most = next(most for most, _ in GEMV_ROW_VARIANTS if rows <= most)
            paired = self._tcp and rows >= self.pair_from
            kern, block_rows = (self._tcp[(epi, most)], 32) if paired else (self._tc_wide[(epi, most)], 16)
        kern(s, (-(-n // block_rows),), x=x, W=w, out=out, M=rows, N=n, K=k, ldo=ldo, ss_in=ss_in[0],
             ss_nparts=ss_in[1], eps=eps, **extra)  # fmt: skip

    def qkv_rope(self, s, x: int, w: int, bias: int, q_out: int, rows: int, heads: int, kv_heads: int, k: int,
                 positions: int, slots: int, inv_freq: int, cache: int, block_size: int, block_stride: int,
                 ss_in: tuple[int, int] = (0, 0), eps: float = 0.0, rotary_dim: int | None = None,
                 factor: float = 1.0) -> None:  # fmt: skip
        """The q|k|v GEMV (``w`` rope-interleaved per head, ``weights.interleave_rope``) with rope and the
        KV write in its epilogue (gemv_tc_rope): q_out bf16 [rows, heads, D] rotated, K rotated and V
        copied into their cache slots, as ``rope_kv_write`` does (``rotary_dim``, ``factor`` as there).
        ``ss_in``: fused RMSNorm as in ``linear``."""
        if not 1 <= rows <= gemv_rows(w) or k % 8:
            raise ValueError(f"qkv_rope needs 1..{gemv_rows(w)} rows and K % 8 == 0 (rows={rows}, K={k})")
        d = self.head_dim
        rd = d if rotary_dim is None else rotary_dim
        if rd % 16 or not 0 <= rd <= d:
            raise ValueError(f"rotary_dim {rd} must be a multiple of 16 in 0..{d}")
        self._gemv_tc(s, ROPE_KV, x, w, q_out, rows, (heads + 2 * kv_heads) * d, k, heads * d, ss_in, eps, bias=bias,
                      positions=positions, slots=slots, inv_freq=inv_freq, cache=cache, H=heads, KVH=kv_heads, D=d,
                      block_size=block_size, block_stride=block_stride, rotary_dim=rd, rope_factor=factor)  # fmt: skip

    def gate_up_act(self, s, x: int, w: int, gu: int, act: int, rows: int, inter: int, k: int,
                    ss_in: tuple[int, int] = (0, 0), eps: float = 0.0, fn: str = "silu") -> None:  # fmt: skip
        """act[rows, inter] = bf16(fn(gate) * up) of x @ w.T (``fn`` "silu": SwiGLU, "gelu_tanh": GeGLU),
        ``w`` the gate|up matrix interleaved in 8-row groups (``weights.interleave_gate_up``). Up to
        ``gemv_rows(w)`` rows the activation is the GEMV's epilogue (no fp32 ``gu`` round trip, one
        launch); wider, gemm_hopper's (sm_90), or elsewhere the GEMM writes ``gu`` and ``swiglu``
        reads it."""
        if k % 8 or inter % 8:
            raise ValueError(f"K={k} and I={inter} must be multiples of 8")
        if 1 <= rows <= min(gemv_rows(w), self.gemv_cap):
            self._gemv_tc(s, GATE_EPILOGUE[fn], x, w, act, rows, 2 * inter, k, inter, ss_in, eps)
            return
        if ss_in[0]:
            raise ValueError(f"fused RMSNorm needs 1..{gemv_rows(w)} rows, got {rows}")
        if self.fp8_prefill(s, x, w, 0, act, rows, 2 * inter, k, inter, act=ACT_CODE[fn]):
            return
        wb = self.as_bf16(s, w, 2 * inter, k)
        fused = getattr(self._gemm, "gate_up", None)  # gemm_hopper: the activation in its epilogue
        if fused is not None and fused(s, x, wb, act, rows, inter, k, ACT_CODE[fn]):
            return
        self.linear(s, x, wb, 0, gu, rows, 2 * inter, k)
        self.swiglu(s, gu, act, inter, rows, interleaved=True, act=fn)

    # --- attention -----------------------------------------------------------------------

    def decode_attention(self, s, q: int, positions: int, block_tables: int, bt_stride: int, cache: int,
                         block_stride: int, block_size: int, kv_heads: int, o_part: int, ml: int, out: int,
                         rows: int, args: AttnArgs | None = None, lane_first: int = 0) -> None:  # fmt: skip
        """Split-K decode attention; the splits are merged inside the same kernel (last block per lane
        and KV head), so this is one launch. ``args``: the layer's scale, soft-cap, window, sinks
        (None: ``plain``). ``lane_first``: int32 [rows], each row's lane's first row (a lane's rows
        consecutive, one block table); with ``decode_lanes`` a round of ``DECODE_LANES_FROM`` rows or more
        then shares a block among a lane's rows."""
        if rows * kv_heads > MAX_COUNTERS:
            raise ValueError(f"{rows} rows x {kv_heads} KV heads exceeds {MAX_COUNTERS} split counters")
        a = args or self.plain
        kern, extra = self._decode_attn, {}
        if self._decode_lanes is not None and lane_first and rows >= DECODE_LANES_FROM:
            kern, extra = self._decode_lanes, {"lane_first": lane_first}
        kern(s, (kv_heads, rows, DECODE_SPLITS), q=q, positions=positions, block_tables=block_tables,
             bt_stride=bt_stride, cache=cache, block_stride=block_stride, block_size=block_size, KVH=kv_heads,
             scale_log2=a.scale_log2, o_part=o_part, ml=ml, counters=self._counters, out=out, window=a.window,
             cap_log2=a.cap_log2, sinks=a.sinks, **extra)  # fmt: skip

    def prefill_attention(self, s, q: int, block_table: int, cache: int, block_stride: int, block_size: int,
                          kv_heads: int, n: int, start: int, out: int, args: AttnArgs | None = None) -> None:  # fmt: skip
        """Causal attention of a chunk's q over the paged cache (its retained prefix whole) into ``out``.
        attention_prefill_hopper.cu where it covers the call (sm_90, head_dim 128, no soft-cap, window
        or sinks, pages of 8, 16, .. 128 or a multiple of 128 rows); attention_prefill.cu otherwise."""
        a = args or self.plain
        fa = self._prefill_hopper
        if fa is not None and not a.cap_log2 and a.window <= 0 and not a.sinks and fa.covers(block_size, q, cache):
            fa(s, q, block_table, cache, block_stride, block_size, kv_heads, n, start, out, a.scale_log2)
            return
        halves = 2 if self.head_dim == 256 else 1  # attention_prefill.cu: HEAD_DIM 256 splits the output dims
        self._prefill_attn(s, ((n + 63) // 64, kv_heads * self.group, halves), q=q, block_table=block_table, cache=cache,
                           block_stride=block_stride, block_size=block_size, KVH=kv_heads, n=n, start=start,
                           scale_log2=a.scale_log2, out=out, window=a.window, cap_log2=a.cap_log2,
                           sinks=a.sinks)  # fmt: skip

    def prefill_attention_spans(self, s, q: int, rows: int, spans: list[tuple[int, int, int, int]], table: int,
                                cache: int, block_stride: int, block_size: int, kv_heads: int, out: int,
                                args: AttnArgs | None = None) -> None:  # fmt: skip
        """``prefill_attention`` of each span of a pass over q / out [rows, H, D]: ``spans`` = (first row, n,
        block table pointer, start) a span. ``table``: the device copy of the spans as int32 rows (first row,
        n, start, first entry of its block table counted from the first span's), which lets the Hopper
        kernel take them in one launch (the same bits as one a span); 0, or a call that kernel does not
        cover: one launch a span."""
        a = args or self.plain
        fa, q_row = self._prefill_hopper, kv_heads * self.group * self.head_dim * 2
        if (
            table
            and len(spans) > 1
            and fa is not None
            and not a.cap_log2
            and a.window <= 0
            and not a.sinks
            and fa.covers(block_size, q, cache)
        ):
            fa.spans(s, q, rows, table, [n for _, n, _, _ in spans], spans[0][2], cache, block_stride, block_size,
                     kv_heads, out, a.scale_log2)  # fmt: skip
            return
        for r0, n, block_table, start in spans:
            self.prefill_attention(s, q + r0 * q_row, block_table, cache, block_stride, block_size, kv_heads, n,
                                   start, out + r0 * q_row, args=a)  # fmt: skip

    # --- sampling ------------------------------------------------------------------------

    def penalties(self, s, logits: int, vocab: int, params: int, pen_tokens: int, pen_counts: int, pen_num: int,
                  pen_stride: int, rows: int) -> None:  # fmt: skip
        self._penalties(s, (rows,), logits=logits, V=vocab, params=params, pen_tokens=pen_tokens,
                        pen_counts=pen_counts, pen_num=pen_num, pen_stride=pen_stride)  # fmt: skip

    def sample(self, s, logits: int, vocab: int, params: int, seeds: int, positions: int, out_tokens: int,
               rows: int) -> None:  # fmt: skip
        self._sample(s, (rows,), logits=logits, V=vocab, params=params, seeds=seeds, positions=positions,
                     out_tokens=out_tokens)  # fmt: skip
