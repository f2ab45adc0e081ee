"""The Hopper prefill kernels (engine/cu/gemm_hopper.cu, attention_prefill_hopper.cu): their TMA
descriptors, variants and launches.

``HopperGemm`` compiles gemm_hopper.cu for sm_90a in six variants (``VARIANTS`` and ``NARROW``:
consumer warpgroups x tile width, each with as many pipeline stages as fit in shared memory) and
launches the one ``pick`` chooses for the shape: ``gemm(s, A, W, bias, C, M, N, K, ldc,
accumulate)`` has ``Kernels.linear``'s GEMM contract, C fp32 [M, ldc] (+)= A bf16 [M, K] @
W bf16 [N, K]^T (+ bias fp32 [N]). ``HopperGemm(fp8=True)`` is the same kernel's fp8 build
(``gemm_hopper_fp8``): A and W float8_e4m3fn bytes, the product times A's row scales and W's
column scales (``sa``, ``sw``), for the prefill of ``FP8`` matrices (``cuda.fp8_gemm``);
``fp8=BLOCK`` the tile-scaled build (``gemm_hopper_fp8b``, 128-column tiles only): scales a row
(column) and 128-wide k block on both sides, for ``FP8B`` matrices.

The TMA tensor maps (``CUtensorMap``, 128 opaque bytes) are encoded on the host by the
driver's ``cuTensorMapEncodeTiled`` (through ctypes: no binding beyond PyCUDA) and passed
by value as the kernel's first two parameters; one is cached per (pointer, rows, K, box),
since the forward pass reuses the same workspace buffers chunk after chunk.

``HopperAttention`` is the prefill attention for head_dim 128 (``covers`` says which calls): q and
the layer's part of the paged KV cache read through 3-D tensor maps, one block a (KV head, 128
rows of positions x grouped heads); ``route_attention`` gives it on an sm_90 device, else None.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct

from engine.cu.launch import CU_DIR, DEFAULT_CACHE_DIR, compiled, when_bound

ARCH = "sm_90a"  # wgmma and setmaxnreg exist only on the "a" target
BK = 64
SMEM_LIMIT = 227 * 1024  # the H100 / H200 per-block opt-in maximum
MAX_STAGES = 8
# (consumer warpgroups, tile width): BM = 64 * warpgroups rows by BN columns a tile
VARIANTS = ((2, 256), (2, 128), (1, 256), (1, 128))
# The bf16 build's narrow tiles, for a few rows (``FEW_ROWS``): 64 x 64 and 64 x 32 tiles, so a
# product of 4,096 columns streams W from 64 or 128 SMs instead of 32 (the fp8 builds keep theirs)
NARROW = ((2, 64), (2, 32), (1, 64), (1, 32))
FEW_ROWS = (33, 128)  # measured faster at 48 and 120 rows on an H100, slower at 16 (docs/CUDA.md)
BLOCK_VARIANTS = ((2, 128), (1, 128))  # the tile-scaled fp8 build: p and d (2 x 64 fp32) in registers
PER_CHANNEL, BLOCK = 1, 2  # HopperGemm(fp8=): gemm_hopper.cu's HG_FP8
PARAMS = ["128s", "128s", "P", "P", "i", "i", "i", "i", "i", "i"]  # tmA, tmW, bias, C, M, N, K, ldc, accumulate, act
PARAMS_FP8 = PARAMS + ["P", "P"]  # ..., sa, sw
_KPARAM_INFO = 0x17

# CUtensorMap enums (cuda.h)
_UINT8, _BF16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO = 0, 9, 0, 3, 3, 0


# A tile's cost in units of a 128 x 256 one: its area over the rate that variant reached at
# M = 8192 on the H200 (bench/bench_gemm.py --variants: 740, 693, 670, 575 TFLOP/s).
TILE_COST = {(2, 256): 1.0, (2, 128): 0.533, (1, 256): 0.553, (1, 128): 0.321}


@functools.lru_cache(maxsize=4096)  # every GEMM launch of a prefill asks (128 a pass of the 8B shape): ~8 us each
def pick(m: int, n: int, sms: int, variants=VARIANTS) -> tuple[int, int]:
    """The variant for an M x N product: the fewest rounds of tiles over the SMs times the tile's
    cost (``TILE_COST``); on a tie the larger tile. Small M gets small tiles (more blocks to
    stream W); 1,024 rows of q,k,v get 128 x 128 (384 tiles, 3 rounds on 132 SMs, cost less
    than 192 wide ones in 2).

    For ``FEW_ROWS`` (33..128) rows, where the product streams W and its arithmetic is small, and with
    the narrow tiles among ``variants``: of the tiles as tall as the rows (W streamed once), the
    narrow one whose busiest block streams the fewest W rows (rounds of tiles times the tile's
    width; then the fewest tiles, then one warpgroup), when that is at most 3/4 of what the best
    wide one streams: 48 rows of o (4,096 x 4,096) go to 128 blocks of 64 x 32 instead of 32 of
    64 x 128; gate|up's 28,672 columns keep 112 wide tiles (224 narrow rows against 256)."""

    def tiles(v: tuple[int, int]) -> int:
        return -(-m // (64 * v[0])) * -(-n // v[1])

    def streamed(v: tuple[int, int]) -> tuple[int, int, int]:
        return -(-tiles(v) // sms) * v[1], tiles(v), v[0]

    tall = [v for v in variants if 64 * v[0] >= m]
    narrow = [v for v in tall if v in NARROW]
    if FEW_ROWS[0] <= m <= FEW_ROWS[1] and narrow:
        best = min(narrow, key=streamed)
        wide = [v for v in tall if v not in NARROW]
        if not wide or streamed(best)[0] <= 0.75 * streamed(min(wide, key=streamed))[0]:
            return best

    def cost(v: tuple[int, int]) -> float:
        return -(-tiles(v) // sms) * TILE_COST[v]

    return min((v for v in variants if v in TILE_COST), key=cost)


def stages(nc: int, bn: int) -> int:
    per_stage = (64 * nc + bn) * BK * 2
    return min(MAX_STAGES, (SMEM_LIMIT - 1024 - 256) // per_stage)


def smem_bytes(nc: int, bn: int) -> int:
    return stages(nc, bn) * (64 * nc + bn) * BK * 2 + 1024 + 256


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int]  # fmt: skip
    return f


def encode_map(ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
               dtype: int = _BF16) -> bytes:  # fmt: skip
    """The 128-byte CUtensorMap of a bf16 (or ``dtype``: ``_UINT8`` for fp8 bytes) tensor at ``ptr``: ``dims``
    innermost first, ``strides`` the byte strides of dims 1.. (multiples of 16), read in boxes of
    ``box`` with the 128-byte swizzle (zeros outside the tensor)."""
    if ptr % 16 or any(st % 16 for st in strides):
        raise ValueError(f"TMA needs a 16-byte aligned tensor and strides (ptr={ptr:#x}, strides={strides})")
    rank = len(dims)
    out = (ctypes.c_uint64 * 16)()
    cdims = (ctypes.c_uint64 * rank)(*dims)
    cstrides = (ctypes.c_uint64 * (rank - 1))(*strides)
    cbox = (ctypes.c_uint32 * rank)(*box)
    elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    res = _libcuda()(out, dtype, rank, ctypes.c_void_p(ptr), cdims, cstrides, cbox, elem, _INTERLEAVE_NONE,
                     _SWIZZLE_128B, _L2_256B, _OOB_ZERO)  # fmt: skip
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {res}) for dims {dims} box {box}")
    return bytes(out)


def tensor_map(ptr: int, rows: int, cols: int, box_rows: int, fp8: bool = False) -> bytes:
    """The tensor map of a row-major bf16 [rows, cols] matrix at ``ptr``, read in boxes of ``box_rows``
    x 64 with the 128-byte swizzle (zeros outside the matrix); ``fp8``: a matrix of bytes, boxes of
    ``box_rows`` x 128 (a 128-byte row either way)."""
    if fp8:
        if ptr % 16 or cols % 16:
            raise ValueError(f"TMA needs a 16-byte aligned matrix and cols % 16 == 0 (ptr={ptr:#x}, cols={cols})")
        return encode_map(ptr, (cols, rows), (cols,), (2 * BK, box_rows), _UINT8)
    if ptr % 16 or cols % 8:
        raise ValueError(f"TMA needs a 16-byte aligned matrix and cols % 8 == 0 (ptr={ptr:#x}, cols={cols})")
    return encode_map(ptr, (cols, rows), (cols * 2,), (BK, box_rows))


def param_layout(cubin: bytes, name: str) -> list[tuple[int, int]]:
    """(offset, size) in bytes of each parameter of kernel ``name``, read from the cubin's
    ``.nv.info.<name>`` section (EIATTR_KPARAM_INFO records). PyCUDA passes parameters as one packed
    buffer, which must follow these offsets; with 64-byte aligned parameters (the tensor maps) they
    do not start at 0 (the parameter bank's base is not 64-byte aligned)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        return struct.unpack_from("<I", cubin, base)[0], *struct.unpack_from("<QQ", cubin, base + 0x18)

    strtab = section(shstrndx)[1]
    want = f".nv.info.{name}".encode()
    for i in range(shnum):
        name_off, off, size = section(i)
        start = strtab + name_off
        if cubin[start : cubin.index(b"\0", start)] == want:
            break
    else:
        raise ValueError(f"no {want.decode()} section in the cubin")
    params: dict[int, tuple[int, int]] = {}
    p, end = off, off + size
    while p < end:
        fmt, attr = cubin[p], cubin[p + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, then the value
            (n,) = struct.unpack_from("<H", cubin, p + 2)
            if attr == _KPARAM_INFO:
                _, ordinal, offset, flags = struct.unpack_from("<IHHI", cubin, p + 4)
                params[ordinal] = (offset, flags >> 18)
            p += 4 + n
        else:  # EIFMT_NVAL / BVAL / HVAL: no value or one in the next two bytes
            p += 2 if fmt == 1 else 4
    return [params[i] for i in range(len(params))]


def pack_format(layout: list[tuple[int, int]], codes: list[str]) -> str:
    """A struct format placing each parameter (``codes``: struct letters) at its offset."""
    out, pos = "", 0
    for (off, size), code in zip(layout, codes, strict=True):
        if struct.calcsize(code) != size or off < pos:
            raise ValueError(f"parameter layout {layout} does not fit {codes}")
        out += (f"{off - pos}x" if off > pos else "") + code
        pos = off + size
    return out


def _build(source: str, defines: dict[str, int], cache_dir: str) -> tuple[str, list[str], str]:
    """(source, nvcc options, cache dir) of a Hopper module: common.cuh, hopper.cuh, ``source``."""
    cache = cache_dir or DEFAULT_CACHE_DIR
    os.makedirs(cache, exist_ok=True)
    src = "\n".join((CU_DIR / f).read_text() for f in ("common.cuh", "hopper.cuh", source))
    return src, ["-O3", "-std=c++17"] + [f"-D{k}={v}" for k, v in defines.items()], cache


def _module(nc: int, bn: int, cache_dir: str, fp8: int = 0):
    """One variant's module (``launch.compiled``: loaded now, or when a ``compiling()`` block binds it);
    ``fp8``: the HG_FP8 build (same tiles and stages: a stage row is 128 bytes either way)."""
    defines = {"HG_NC": nc, "HG_BN": bn, "HG_STAGES": stages(nc, bn)} | ({"HG_FP8": fp8} if fp8 else {})
    return compiled(("gemm_hopper", nc, bn, cache_dir, fp8), lambda: _build("gemm_hopper.cu", defines, cache_dir),
                    arch=ARCH)  # fmt: skip


def _prepare(mod, fn, name: str, codes: list[str], smem: int) -> None:
    """Once ``fn`` (kernel ``name`` of ``mod``) is bound: its dynamic shared memory and its prepare()
    format, the parameters at the offsets the cubin gives (``param_layout``)."""
    import pycuda.driver as cuda

    def prepare(f) -> None:
        f.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        f.prepare(pack_format(param_layout(mod.cubin(), name), codes))

    when_bound(fn, prepare)


def supported() -> bool:
    """Whether the current device runs sm_90a code (compute capability 9.0: H100, H200)."""
    import pycuda.driver as cuda

    return cuda.Context.get_device().compute_capability() == (9, 0)


class HopperGemm:
    """gemm_hopper's variants, compiled and prepared for the current context's device; ``fp8``
    ``PER_CHANNEL``: the fp8 build's (gemm_hopper_fp8: A and W e4m3 bytes, calls pass ``sa`` and ``sw``),
    ``BLOCK``: the tile-scaled one's (gemm_hopper_fp8b, ``BLOCK_VARIANTS``)."""

    def __init__(self, cache_dir: str = "", fp8: int = 0, narrow: bool = True) -> None:
        import pycuda.driver as cuda

        dev = cuda.Context.get_device()
        self.sms = dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        self.fp8 = int(fp8)
        name, params = {0: ("gemm_hopper", PARAMS), PER_CHANNEL: ("gemm_hopper_fp8", PARAMS_FP8),
                        BLOCK: ("gemm_hopper_fp8b", PARAMS_FP8)}[self.fp8]  # fmt: skip
        self.variants = (
            BLOCK_VARIANTS if self.fp8 == BLOCK else VARIANTS if self.fp8 or not narrow else VARIANTS + NARROW
        )
        self._fns = {}
        for nc, bn in self.variants:
            mod = _module(nc, bn, cache_dir, fp8)
            fn = mod.get_function(name)  # a LazyFunction inside launch.compiling()
            _prepare(mod, fn, name, params, smem_bytes(nc, bn))
            self._fns[(nc, bn)] = fn
        self._maps: dict[tuple[int, int, int, int], bytes] = {}
        self._plans: dict[tuple, tuple] = {}  # (m, n, variant) -> (function, grid, block, bm, bn, shared bytes)

    def pick(self, m: int, n: int) -> tuple[int, int]:
        return pick(m, n, self.sms, self.variants)

    def _map(self, ptr: int, rows: int, k: int, box: int) -> bytes:
        key = (ptr, rows, k, box)
        tm = self._maps.get(key)
        if tm is None:
            if len(self._maps) > 4096:
                self._maps.clear()
            tm = self._maps[key] = tensor_map(ptr, rows, k, box, bool(self.fp8))
        return tm

    def __call__(self, s, a: int, w: int, bias: int, c: int, m: int, n: int, k: int, ldc: int | None = None,
                 accumulate: bool = False, variant: tuple[int, int] | None = None, act: int = -1, sa: int = 0,
                 sw: int = 0) -> None:  # fmt: skip
        """c[m, :n] (+)= a[m, k] @ w[n, k].T (+ bias) on stream ``s``; ``variant`` forces one of ``VARIANTS``.
        ``act`` 0 / 1: c is bf16 [m, ldc] and gets silu / gelu_tanh(gate) * up of the interleaved gate|up
        product (n / 2 columns; gemm_hopper.cu). The fp8 build: a and w e4m3 bytes (k % 16 == 0), the
        product times ``sa`` fp32 [m] and ``sw`` fp32 [n] (both needed) before bias, act, accumulate;
        the tile-scaled one: ``sa`` [m, ceil(k / 128)] and ``sw`` [n, ceil(k / 128)]."""
        if self.fp8 and (k % 16 or not sa or not sw or int(sa) % 4 or int(sw) % 4):
            raise ValueError(f"gemm_hopper_fp8 needs K % 16 == 0 and both scale vectors (K={k})")
        if act >= 0:
            ldc = n // 2 if ldc is None else ldc
            if k % 8 or n % 16 or ldc % 2 or ldc < n // 2 or int(c) % 4 or bias or accumulate:
                raise ValueError(f"fused gate|up needs K % 8 == 0, N % 16 == 0, an even ldc >= N / 2, no bias or "
                                 f"accumulate (K={k}, N={n}, ldc={ldc})")  # fmt: skip
        else:
            ldc = n if ldc is None else ldc
            if k % 8 or ldc % 2 or ldc < n or int(c) % 8:
                raise ValueError(f"gemm_hopper needs K % 8 == 0, an even ldc >= N, C 8-byte aligned (K={k}, ldc={ldc})")
        if m <= 0 or n <= 0:
            return
        key = (m, n, variant)
        plan = self._plans.get(key)
        if plan is None:  # (a prefill's few shapes: kept, the step thread asks 128 times a pass of the 8B shape)
            nc, bn = variant or pick(m, n, self.sms, self.variants)
            tiles = -(-m // (64 * nc)) * -(-n // bn)
            plan = (self._fns[(nc, bn)], (min(tiles, self.sms), 1, 1), (128 * (nc + 1), 1, 1), 64 * nc, bn,
                    smem_bytes(nc, bn))  # fmt: skip
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = plan
        fn, grid, block, bm, bn, smem = plan
        scales = (int(sa), int(sw)) if self.fp8 else ()
        # plain ints: PyCUDA packs them as np.int32 and refuses one out of range (engine/cu/launch.py's
        # binder says why the host time of a launch matters)
        fn.prepared_async_call(grid, block, s, self._map(int(a), m, k, bm), self._map(int(w), n, k, bn), int(bias),
                               int(c), int(m), int(n), int(k), int(ldc), int(bool(accumulate)), int(act), *scales,
                               shared_size=smem)  # fmt: skip


class GemmRoute:
    """Kernels' GEMM launch (a ``launch.Kernel`` call: ``(s, grid, A=, W=, bias=, C=, M=, N=, K=, ldc=,
    accumulate=)``) sent to gemm_hopper, or to ``fallback`` (gemm_bf16) where gemm_hopper's
    alignment preconditions do not hold."""

    def __init__(self, fallback, hopper: HopperGemm) -> None:
        self.fallback, self.hopper = fallback, hopper

    @property
    def fn(self):
        return self.fallback.fn

    def __call__(self, s, grid, *, A, W, bias, C, M, N, K, ldc, accumulate) -> None:
        if K % 8 == 0 and ldc % 2 == 0 and ldc >= N and int(A) % 16 == 0 and int(W) % 16 == 0 and int(C) % 8 == 0:
            self.hopper(s, A, W, bias, C, M, N, K, ldc, accumulate=bool(accumulate))
        else:
            self.fallback(s, grid, A=A, W=W, bias=bias, C=C, M=M, N=N, K=K, ldc=ldc, accumulate=accumulate)

    def gate_up(self, s, x: int, w: int, out: int, rows: int, inter: int, k: int, act: int) -> bool:
        """out bf16 [rows, inter] = act(gate) * up of x @ w.T (w interleaved gate|up) in the GEMM's
        epilogue; False (nothing launched) where gemm_hopper's preconditions do not hold."""
        if k % 8 or inter % 8 or int(x) % 16 or int(w) % 16 or int(out) % 4:
            return False
        self.hopper(s, x, w, 0, out, rows, 2 * inter, k, inter, act=act)
        return True


def route_gemm(gemm, cache_dir: str = "", narrow: bool = True):
    """``gemm`` (gemm_bf16's Kernel) behind gemm_hopper on an sm_90 device (``narrow``: with the
    ``NARROW`` tiles); ``gemm`` itself elsewhere."""
    return GemmRoute(gemm, HopperGemm(cache_dir, narrow=narrow)) if supported() else gemm


# --- prefill attention (attention_prefill_hopper.cu) -----------------------------------------

FA_BM, FA_KT, FA_D = 128, 128, 128  # rows a block, keys a tile, head_dim
FA_THREADS = 384
FA_VARIANT = (128, 3, 1)  # (P V wgmma width, K/V stages, ping-pong): the default
FA_VARIANTS = ((128, 3, 1), (64, 3, 1), (128, 2, 1), (128, 3, 0))  # what bench_cuda.py --attention times
FA_PARAMS = ["128s", "128s", "P", "i", "i", "i", "i", "i", "f", "P"]  # tmQ, tmKV, block_table, block_size,
# block_rows, KVH, n, start, scale_log2, out
FA_SPANS_PARAMS = ["128s", "128s", "P", "P", "i", "i", "i", "i", "f", "P"]  # tmQ, tmKV, block_tables, spans,
# num_spans, block_size, block_rows, KVH, scale_log2, out (prefill_attn_hopper_spans)
KV_ROWS_BOUND = (1 << 31) - 1  # the cache map's row extent: rows are addressed through the block table


def attention_covers(head_dim: int, group: int, block_size: int) -> bool:
    """Whether attention_prefill_hopper.cu takes this shape: head_dim 128, a group dividing the block's 128
    rows, pages of a multiple of 8 rows that tile the 128-key tiles (or are tiled by them)."""
    pages_fit = block_size % 8 == 0 and (FA_KT % block_size == 0 or block_size % FA_KT == 0)
    return head_dim == FA_D and group in (1, 2, 4, 8) and pages_fit


_covers = functools.lru_cache(maxsize=64)(attention_covers)  # every prefill attention launch asks (twice)


def _attention_module(group: int, variant: tuple[int, int, int], cache_dir: str):
    pvn, stages, pingpong = variant
    defines = {"GROUP": group, "FA_PVN": pvn, "FA_STAGES": stages, "FA_PINGPONG": pingpong}
    build = lambda: _build("attention_prefill_hopper.cu", defines, cache_dir)  # noqa: E731
    return compiled(("attention_hopper", group, variant, cache_dir), build, arch=ARCH)


def attention_smem(stages: int) -> int:
    return (FA_BM * FA_D + 2 * stages * FA_KT * FA_D) * 2 + 1024 + 256


class HopperAttention:
    """prefill_attn_hopper for one group size, compiled and prepared for the current device. ``variant``:
    (P V as one n128 wgmma a k16 step (128) or two n64 (64), K/V stages, ping-pong 1 / 0)."""

    def __init__(self, group: int, cache_dir: str = "", variant: tuple[int, int, int] = FA_VARIANT) -> None:
        self.group, self.smem = group, attention_smem(variant[1])
        mod = _attention_module(group, variant, cache_dir)
        self.fn = mod.get_function("prefill_attn_hopper")  # a LazyFunction inside launch.compiling()
        _prepare(mod, self.fn, "prefill_attn_hopper", FA_PARAMS, self.smem)
        self.fn_spans = mod.get_function("prefill_attn_hopper_spans")
        _prepare(mod, self.fn_spans, "prefill_attn_hopper_spans", FA_SPANS_PARAMS, self.smem)
        self._maps: dict[tuple, bytes] = {}

    def covers(self, block_size: int, q: int, cache: int) -> bool:
        return _covers(FA_D, self.group, block_size) and int(q) % 16 == 0 and int(cache) % 16 == 0

    def _map(self, ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]) -> bytes:
        key = (ptr, dims, strides, box)
        tm = self._maps.get(key)
        if tm is None:
            if len(self._maps) > 4096:
                self._maps.clear()
            tm = self._maps[key] = encode_map(ptr, dims, strides, box)
        return tm

    def __call__(self, s, q: int, block_table: int, cache: int, block_stride: int, block_size: int, kv_heads: int,
                 n: int, start: int, out: int, scale_log2) -> None:  # fmt: skip
        """out[n, H * 128] = causal attention of q [n, H, 128] (positions start..) over the paged cache."""
        q, cache = int(q), int(cache)
        if not self.covers(block_size, q, cache):
            raise ValueError(f"prefill_attn_hopper does not take block_size {block_size} / unaligned q or cache")
        if n <= 0:
            return
        g, d, h = self.group, FA_D, kv_heads * self.group
        if block_stride % (kv_heads * d):
            raise ValueError(f"block_stride {block_stride} is not a whole number of [KVH][D] rows")
        tmq, tmkv = self._q_map(q, h, n), self._kv_map(cache, kv_heads, block_size)
        blocks = -(-n // (FA_BM // g))
        # plain ints and a float: PyCUDA packs them as np.int32 / np.float32 (engine/cu/launch.py's binder)
        self.fn.prepared_async_call((kv_heads, blocks, 1), (FA_THREADS, 1, 1), s, tmq, tmkv, int(block_table),
                                    int(block_size), int(block_stride // (kv_heads * d)), int(kv_heads), int(n),
                                    int(start), float(scale_log2), int(out), shared_size=self.smem)  # fmt: skip

    def spans(self, s, q: int, rows: int, spans: int, counts: list[int], block_tables: int, cache: int,
              block_stride: int, block_size: int, kv_heads: int, out: int, scale_log2) -> None:  # fmt: skip
        """Several spans' attention in one launch (prefill_attn_hopper_spans; each span's rows the bits
        ``__call__`` gives it alone): q / out [rows, H, 128] the pass's rows; ``spans`` int32 [len(counts)][4]
        on the device, a span's (first row, n, start, first entry of its table in ``block_tables``);
        ``counts`` its n on the host (the grid)."""
        q, cache = int(q), int(cache)
        if not self.covers(block_size, q, cache):
            raise ValueError(f"prefill_attn_hopper does not take block_size {block_size} / unaligned q or cache")
        if block_stride % (kv_heads * FA_D):
            raise ValueError(f"block_stride {block_stride} is not a whole number of [KVH][D] rows")
        pb = FA_BM // self.group
        blocks = sum(-(-n // pb) for n in counts)
        if blocks == 0:
            return
        h = kv_heads * self.group
        self.fn_spans.prepared_async_call((kv_heads, blocks, 1), (FA_THREADS, 1, 1), s, self._q_map(q, h, rows),
                                          self._kv_map(cache, kv_heads, block_size), int(block_tables), int(spans),
                                          len(counts), int(block_size), int(block_stride // (kv_heads * FA_D)),
                                          int(kv_heads), float(scale_log2), int(out), shared_size=self.smem)  # fmt: skip

    def _q_map(self, q: int, h: int, n: int) -> bytes:
        """The map of q [n, h, 128] at ``q`` (a layer's: the few buffers and row counts a pass has)."""
        key = (q, h, n)
        tm = self._maps.get(key)
        if tm is None:
            g, d = self.group, FA_D
            tm = self._maps[key] = self._map(q, (d, h, n), (d * 2, h * d * 2), (64, g, FA_BM // g))
        return tm

    def _kv_map(self, cache: int, kv_heads: int, block_size: int) -> bytes:
        """The map of a layer's cache at ``cache``, boxes of one page (up to a key tile) of one KV head."""
        key = (cache, kv_heads, block_size)
        tm = self._maps.get(key)
        if tm is None:
            d = FA_D
            row = kv_heads * d * 2  # bytes between a page's token rows
            tm = self._map(cache, (d, kv_heads, KV_ROWS_BOUND), (d * 2, row), (64, 1, min(block_size, FA_KT)))
            self._maps[key] = tm
        return tm


def route_attention(head_dim: int, group: int, cache_dir: str = "") -> HopperAttention | None:
    """prefill_attn_hopper for this head size and group on an sm_90 device, or None (attention_prefill.cu)."""
    if head_dim != FA_D or group not in (1, 2, 4, 8) or not supported():
        return None
    return HopperAttention(group, cache_dir)
