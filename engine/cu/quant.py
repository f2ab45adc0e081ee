"""Weight formats on the device, and the kernels of gemv_q.cu (one compiled module per format).

A weight matrix is a :class:`Matrix`: its rows as one or more :class:`Part`, each part in
one format, stacked along the rows (a fused q|k|v whose v is stored in another GGML type
than q and k is two parts). Formats: ``"bf16"`` (gemv.cu / gemm.cu read it), and the GGUF
block types of ``QUANT_FORMATS``, kept exactly as the file stores them (rows of blocks,
``row_bytes``); gemv_q.cu reads those in decode rounds, and prefill dequantizes a matrix
to a bf16 scratch buffer for the GEMM (``QuantKernels.dequantize``). ``"FP8"``: float8_e4m3fn
bytes ``[rows, k]`` then the part's fp32 per-output-channel scales ``[rows]`` (an
``engine.loaders.fp8.Fp8Tensor`` with ``block`` None), read by gemv_q.cu's fp8 main loop;
``"FP8B"``: the same bytes, then fp32 scales ``[rows, ceil(k / 128)]`` (a block-wise checkpoint's
128 x 128 tile scales, each repeated over the tile's rows so that a row carries its own). The
backend only passes ``Matrix`` objects around.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cu.launch import Kernel, module

BF16 = "bf16"
# GGUF block types gemv_q.cu reads as stored: name -> (GGML type id, values a block, bytes a block),
# as engine.loaders.gguf.BLOCK_TYPES.
QUANT_FORMATS = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}  # fmt: skip
FP8 = "FP8"  # e4m3 rows then fp32 scales (not a GGUF type: the loader never keeps it as stored)
FP8_QTYPE = 200  # gemv_q.cu's QFP8
FP8B = "FP8B"  # e4m3 rows then fp32 scales a row and FP8_BLOCK columns (gemv_q.cu's QFP8B)
FP8B_QTYPE = 201
FP8_BLOCK = 128
FP8_FORMATS = (FP8, FP8B)
# gemv_q.cu's (QU, QMINB, QNST[, QKH[, QUF]]): units of 64 values a warp takes from each stage (a
# multiple of 4 for the K-quants: whole super-blocks), blocks per SM the registers must allow, stages in
# flight, for Q4_K / Q5_K whether a super-block's scales are computed once a warp (1, the default), and
# units loaded before their decode (2).
# Q8_0 (2, 4, 2): 10% faster than (2, 3, 3) on gate,up (docs/QUANT.md).
# FP8 / FP8B: QU steps in flight, no stages.
QUANT_TUNING: dict[str, tuple[int, ...]] = {"Q8_0": (2, 4, 2), "FP8": (4, 2, 1), "FP8B": (4, 2, 1)}
DEFAULT_TUNING = (4, 3, 2)
TC_THREADS = 256
DEQUANT_THREADS = 256
TC_ROWS = 16
# cuda.quant_activations: the formats whose GEMV has gemv_q.cu's int8-activation main loop (QACT8);
# the others (FP8, FP8B) keep bf16 activations.
QACT8_FORMATS = frozenset(QUANT_FORMATS)
QACT_THREADS = 128  # quant_act.cu: a thread a (row, group of 32)
QACT_MAX_ROWS = 8
QF8_THREADS = 256  # quant_act.cu's quant_act_fp8: a block a row (the fp8 prefill GEMM's x)


def quant_act_bytes(k: int, rows: int = QACT_MAX_ROWS) -> int:
    """Bytes of quant_act.cu's buffer for ``rows`` activation rows of ``k`` values: int8 [rows, k],
    then a float2 (dx, dx xsum) per group of 32 and row of 8."""
    return rows * k + (k // 32) * QACT_MAX_ROWS * 8


def stage_smem(fmt: str, units: int, stages: int) -> int:
    """Dynamic shared memory of gemv_q.cu's block formats: ``stages`` slots of 16 rows, each row's
    piece (8 warps x ``units`` x 64 values) with its two partial 16-byte ends, padded as gemv_q.cu's
    RS: Q4_K / Q5_K (8-byte reads) to 32 mod 128 bytes, the others to an odd number of 16-byte units."""
    if fmt in FP8_FORMATS:
        return 0
    _, qk, bb = QUANT_FORMATS[fmt]
    piece = 8 * units * 64 // qk * bb
    rs = -(-piece // 16) * 16 + 32
    if fmt in ("Q4_K", "Q5_K"):
        rs = (rs + 95) // 128 * 128 + 32
    else:
        rs += 0 if (rs // 16) % 2 else 16
    return stages * TC_ROWS * rs


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of ``k`` values in ``fmt``."""
    if fmt == BF16:
        return 2 * k
    if fmt in FP8_FORMATS:
        if k % 16:
            raise ValueError(f"FP8 rows are read in 16-byte chunks: K={k} must be a multiple of 16")
        return k + 4 * (1 if fmt == FP8 else -(-k // FP8_BLOCK))  # the bytes and the row's fp32 scale(s)
    _, qk, bb = QUANT_FORMATS[fmt]
    if k % qk:
        raise ValueError(f"{fmt} rows hold whole blocks of {qk} values, not {k}")
    return k // qk * bb


@dataclass(frozen=True)
class Part:
    ptr: int  # device address of the part's first row
    fmt: str  # BF16, FP8, FP8B or a QUANT_FORMATS name
    rows: int


@dataclass(frozen=True)
class Matrix:
    """A ``[rows, k]`` weight on the device, as parts of one format each stacked along the rows."""

    parts: tuple[Part, ...]
    k: int

    @classmethod
    def bf16(cls, ptr: int, rows: int, k: int) -> Matrix:
        return cls((Part(ptr, BF16, rows),), k)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.fmt for p in self.parts)

    @property
    def ptr(self) -> int:
        """The first part's address (a one-part bf16 matrix: the plain pointer the bf16 kernels take)."""
        return self.parts[0].ptr

    @property
    def nbytes(self) -> int:
        return sum(p.rows * row_bytes(p.fmt, self.k) for p in self.parts)


# gemv_q.cu's parameters: gemv.cu's per epilogue (kernels.TC_PARAMS), the rope one with its part's row.
def _gemv_params(tc_params: dict[str, str], epi: str) -> str:
    return tc_params[epi] + (" n_base:i32" if epi == "rope" else "")


def gemv_q_defines(fmt: str, tuning: tuple[int, ...] | None = None, act8: bool = False,
                   probe: int = 0) -> tuple[tuple[tuple[str, int], ...], int]:  # fmt: skip
    """gemv_q.cu's defines for ``fmt`` at ``tuning`` (QU, QMINB, QNST[, QKH[, QUF]]; QKH 1, QUF 2 unless
    given; None: the committed one), and its dynamic shared memory (QSMEM)."""
    tid = {FP8: FP8_QTYPE, FP8B: FP8B_QTYPE}.get(fmt) or QUANT_FORMATS[fmt][0]
    tune = tuple(tuning or QUANT_TUNING.get(fmt, DEFAULT_TUNING))
    u, minb, nst = tune[:3]
    kh = tune[3] if len(tune) > 3 else 1
    uf = tune[4] if len(tune) > 4 else 2
    smem = stage_smem(fmt, u, nst)
    defines = (("TC_THREADS", TC_THREADS), ("GEMV_EPILOGUES_ONLY", 1), ("QTYPE", tid), ("QU", u), ("QMINB", minb),
               ("QNST", nst), ("QSMEM", smem), ("QKH", kh))  # fmt: skip
    if uf != 2:  # units loaded before their decode (bench/quant_probe.py's sweeps)
        defines += (("QUF", uf),)
    if act8:
        if fmt not in QACT8_FORMATS:
            raise ValueError(f"{fmt}: no int8-activation GEMV")
        defines += (("QACT8", 1),)
    if probe:  # bench/quant_probe.py: gemv_q.cu's QPROBE, half of the main loop timed alone
        defines += (("QPROBE", probe),)
    return defines, smem


class QuantKernels:
    """gemv_q.cu compiled for one format: the GEMV per epilogue and the dequant to bf16 / fp32.
    ``act8``: the GEMV's int8-activation main loop (QACT8; its x is quant_act.cu's buffer, not bf16).
    ``carveout``: the shared-memory share of the SM's L1 the GEMV prefers, in percent (the rest is L1)."""

    def __init__(self, fmt: str, tc_params: dict[str, str], cache_dir: str = "",
                 tuning: tuple[int, ...] | None = None, act8: bool = False, probe: int = 0,
                 carveout: int = 100) -> None:  # fmt: skip
        import pycuda.driver as cuda

        defines, self.smem = gemv_q_defines(fmt, tuning, act8, probe)
        self.fmt, minb = fmt, dict(defines)["QMINB"]
        self.act8 = act8
        # Blocks resident at once (QMINB an SM): the grid of a persistent launch (``grid``).
        self.resident = minb * cuda.Context.get_device().get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        mod = module("gemv_q", defines, cache_dir, ("gemv",))
        self.gemv = {}
        for epi in tc_params:
            k = Kernel(mod, f"gemv_q_{epi}", _gemv_params(tc_params, epi), TC_THREADS, shared=self.smem)
            if self.smem:  # the kernel's static shared memory counts too against the 48 KB default
                k.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
                # the stages, not L1, want the SM's memory (QMINB blocks of them an SM)
                attr = getattr(cuda.function_attribute, "PREFERRED_SHARED_MEMORY_CARVEOUT", None)
                if attr is not None:
                    k.fn.set_attribute(attr, carveout)
            self.gemv[epi] = k
        self._dequant = {
            dt: Kernel(mod, f"dequant_q_{dt}", "W:ptr out:ptr N:i32 K:i32", DEQUANT_THREADS) for dt in ("bf16", "f32")
        }

    def grid(self, rows: int, persist: bool) -> tuple[int]:
        """The GEMV's grid for a part of ``rows`` rows: a block a 16-row tile, or with ``persist`` at most
        the resident blocks, each walking tiles (its stage pipeline runs on from one into the next)."""
        tiles = -(-rows // TC_ROWS)
        return (min(tiles, self.resident) if persist else tiles,)

    def dequantize(self, s, w: int, out: int, n: int, k: int, dtype: str = "bf16") -> None:
        """out[n, k] (bf16 or fp32) = the ``n`` rows of blocks at ``w``, as gguf's dequantize computes them."""
        row_bytes(self.fmt, k)  # checks whole blocks
        if self.fmt in FP8_FORMATS:
            threads = n * k // 16  # a thread: one 16-byte chunk
        else:
            threads = n * -(-k // 64) * 4  # a thread: 8 + 8 values of each of a unit's two groups (gemv_q.cu)
        self._dequant[dtype](s, (-(-threads // DEQUANT_THREADS),), W=w, out=out, N=n, K=k)
