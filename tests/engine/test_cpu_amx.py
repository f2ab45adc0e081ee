"""The amx build's products against numpy and against the avx2vnni build, bit for bit.

What is promised: every product of the amx build (prefill chunks through the tiles; decode rounds
through the tiles from ``ig_amx_rows`` rows on, 3 by default, and through AVX2 block sums below)
has the bits of avx2vnni's tiled (prefill) product, so a row's bits do not depend on the rows
beside it at any width; with ``ig_amx_rows(0)`` decode rounds have avx2vnni's decode bits.
Fresh random Q8_0 / Q4_0 / Q4_1 matrices each run; everything skips where the processor (or its
kernel) lends no AMX.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import DecodeLane
from tests.engine.test_cpu_backend import _kernels, _load, _prefill_logits, _quantized_x, _tiny
from tests.engine.test_hf_parity import GREEDY, rel_err

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    """The amx and avx2vnni kernels (amx skips here without the tiles)."""
    return _kernels("amx"), _kernels("avx2vnni")


@pytest.fixture
def amx_rows(pair):
    """Sets ig_amx_rows for one test, then back to what it was (the default, 3)."""
    was = pair[0].lib.ig_amx_rows(3)
    pair[0].lib.ig_amx_rows(was)
    assert was == 3
    yield pair[0].lib.ig_amx_rows
    pair[0].lib.ig_amx_rows(was)


def _parts(ks, rng, specs, cols):
    """The same quantized matrices as ig_mat parts of each module; the numpy dequantization."""
    qs = [(t, quantize(rng.standard_normal((r, cols)).astype(np.float32), t)) for t, r in specs]
    out = []
    for k in ks:
        parts = k.ffi.new(f"ig_mat[{len(qs)}]")
        for p, (t, q) in zip(parts, qs):
            p.type, p.rows, p.cols, p.row_bytes = int(t), q.shape[0], cols, q.shape[1]
            p.data = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(q))
        out.append(parts)
    w = np.concatenate([dequantize(q, t).reshape(q.shape[0], cols) for t, q in qs])
    return out, qs, w


def _product(k, fn, parts, xq, rows, width, threads, nparts):
    y = np.full((rows, width), np.nan, np.float32)
    fn(parts, nparts, xq, rows, k.ffi.cast("float *", k.ffi.from_buffer(y)), width, threads)
    return y


# three types fused, a part of 11 rows (a short strip) and one of 40 (two and a half strips)
SPECS = [(T.Q4_1, 24), (T.Q8_0, 13), (T.Q4_0, 11), (T.Q8_0, 40)]


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 15, 16, 17, 20, 33, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_tile_product_matches_numpy_and_the_avx2_tiled_bits(pair, rows, threads):
    amx, vnni = pair
    rng = np.random.default_rng()
    (pa, pv), _keep, w = _parts(pair, rng, SPECS, 192)
    x = rng.standard_normal((rows, 192)).astype(np.float32)
    xa, buf = _quantized_x(amx, x)
    xv, _ = _quantized_x(vnni, x)
    got = _product(amx, amx.lib.ig_matmul_tiled, pa, xa, rows, w.shape[0], threads, len(SPECS))
    xd = (buf["d"][:, None] * buf["q"]).reshape(rows, 192)
    ref = xd.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert rel_err(got, x @ w.T) < 1e-4
    assert np.array_equal(got, _product(vnni, vnni.lib.ig_matmul_tiled, pv, xv, rows, w.shape[0], threads, len(SPECS)))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_each_type_alone_at_the_model_widths(pair, t):
    """A whole matrix of one type (Q8_0's tile A straight from the stored rows), 576 and 1536 wide."""
    amx, vnni = pair
    rng = np.random.default_rng()
    for cols in (576, 1536):
        (pa, pv), _keep, w = _parts(pair, rng, [(t, 64)], cols)
        x = rng.standard_normal((9, cols)).astype(np.float32)
        got = _product(amx, amx.lib.ig_matmul_tiled, pa, _quantized_x(amx, x)[0], 9, 64, 2, 1)
        want = _product(vnni, vnni.lib.ig_matmul_tiled, pv, _quantized_x(vnni, x)[0], 9, 64, 2, 1)
        assert np.array_equal(got, want)
        assert rel_err(got, x @ w.T) < 1e-4


def test_decode_products_have_the_tiled_bits_at_every_width(pair, amx_rows):
    amx, vnni = pair
    rng = np.random.default_rng()
    (pa, pv), _keep, w = _parts(pair, rng, SPECS, 160)
    n = w.shape[0]

    def both(rows):
        x = rng.standard_normal((rows, 160)).astype(np.float32)
        xa, xv = _quantized_x(amx, x)[0], _quantized_x(vnni, x)[0]
        got = _product(amx, amx.lib.ig_matmul, pa, xa, rows, n, 2, len(SPECS))
        decode = _product(vnni, vnni.lib.ig_matmul, pv, xv, rows, n, 2, len(SPECS))
        tiled = _product(vnni, vnni.lib.ig_matmul_tiled, pv, xv, rows, n, 2, len(SPECS))
        return got, decode, tiled

    for limit in (3, 5):  # below the limit AVX2 block sums, from it on the tiles
        amx_rows(limit)
        for rows in (1, 2, 3, 4, 5, 8, 19):
            got, decode, tiled = both(rows)
            assert np.array_equal(got, tiled)
            assert not np.array_equal(got, decode)  # the two orders of float sums do differ (this could fail)
            assert np.abs(got - decode).max() <= 1e-5 * np.abs(decode).max()
    amx_rows(0)  # the other builds' decode path
    for rows in (1, 8, 16):
        got, decode, tiled = both(rows)
        assert np.array_equal(got, decode)


def test_tile_rows_do_not_depend_on_their_neighbours(pair):
    amx, _ = pair
    rng = np.random.default_rng()
    (pa, _), _keep, w = _parts(pair, rng, SPECS, 160)
    x = rng.standard_normal((23, 160)).astype(np.float32)
    together = _product(amx, amx.lib.ig_matmul_tiled, pa, _quantized_x(amx, x)[0], 23, w.shape[0], 2, len(SPECS))
    for r in (0, 15, 16, 22):
        alone = _quantized_x(amx, x[r : r + 1])[0]
        assert np.array_equal(_product(amx, amx.lib.ig_matmul_tiled, pa, alone, 1, w.shape[0], 1, len(SPECS))[0],
                              together[r])  # fmt: skip


def test_tiny_model_against_avx2vnni(pair, amx_rows):
    """With ig_amx_rows(0) a tiled prefill chunk (products through the tiles), a short one and decode
    rounds have avx2vnni's bits; by default the decode products (the lm_head's too) carry the tiled
    bits: close to them."""
    from engine.backends.cpu import CpuBackend

    cfg, stored, _ = _tiny()
    rng = np.random.default_rng()
    ids = [list(rng.integers(3, cfg.vocab_size, n)) for n in (40, 9)]
    runs = {}
    for isa, limit in (("amx", 3), ("amx", 0), ("avx2vnni", 3)):
        amx_rows(limit)
        cpu = _load(CpuBackend(threads=2, isa=isa), cfg, stored)
        assert cpu.isa == isa
        logits = [_prefill_logits(cpu, p, [3 * i, 3 * i + 1, 3 * i + 2]) for i, p in enumerate(ids)]
        lanes = [DecodeLane(i, int(logits[i].argmax()), len(p), [3 * i, 3 * i + 1, 3 * i + 2], GREEDY)
                 for i, p in enumerate(ids)]  # fmt: skip
        runs[isa, limit] = (logits[0], logits[1], cpu.decode_logits(lanes))
    tiled, short, decode = runs["avx2vnni", 3]
    assert all(np.array_equal(a, b) for a, b in zip(runs["amx", 0], runs["avx2vnni", 3]))
    got = runs["amx", 3]
    # sums in another order, then int16 activations and float16 K/V rounded again (as tiled against untiled)
    assert rel_err(got[0], tiled) < 1e-3 and rel_err(got[1], short) < 1e-3 and rel_err(got[2], decode) < 1e-3


def test_a_kernel_that_refuses_the_tiles_falls_back_with_one_log_line(monkeypatch, caplog):
    from engine.backends.cpu import CpuBackend, build

    _kernels("amx")
    real = build._build

    def refusing(isa, cache):
        module = real(isa, cache)
        if isa != "amx":
            return module

        class Lib:
            def __getattr__(self, name):
                return (lambda: -1) if name == "ig_amx_init" else getattr(module.lib, name)

        return type("Refused", (), {"lib": Lib(), "ffi": module.ffi})()

    monkeypatch.setattr(build, "_build", refusing)
    monkeypatch.setattr(build, "_loaded", {})
    with caplog.at_level("WARNING", logger="ignis.engine"):
        backend = CpuBackend(threads=1)
    assert backend.isa == "avx2vnni"
    assert [r.getMessage() for r in caplog.records] == ["ignis.cpu.amx_refused"]
    assert not build.runnable_isas(build.cpu_flags() - {"amx_tile"})[0] == "amx"


# --- repacked tiles: the copy made at load (ig_amx_repack) ----------------------------------

TILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")  # exact int8 weights, a scale (and offset) a 32


def _raw(fmt, rows, cols, rng):
    from tests.engine.test_cpu_kquants import random_blocks

    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[fmt])
    return random_blocks(fmt, rows, cols, gen=rng)


def _struct(k, fmt, raws, cols, repack):
    """ig_mat parts of k over the same blocks; with ``repack`` each gets its tile copy (kept in the list)."""
    parts, keep = k.ffi.new(f"ig_mat[{len(raws)}]"), []
    for i, raw in enumerate(raws):
        p = parts + i
        p.type, p.rows, p.cols, p.row_bytes = int(T[fmt]), raw.shape[0], cols, raw.shape[1]
        p.data = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(raw))
        size = k.lib.ig_amx_repack_bytes(p)
        if repack:
            assert size == (p.rows + 15) // 16 * (cols // 32) * (
                640 if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 576
            )
            buf = np.empty(size + 64, np.uint8)
            copy = buf[-buf.ctypes.data % 64 :][:size]
            copy[:] = 0xAA  # every byte is written by the repack (else the products below would differ)
            k.lib.ig_amx_repack(p, k.ffi.cast("uint8_t *", k.ffi.from_buffer(copy)))
            p.tiles = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(copy))
            keep.append(buf)
    return parts, keep


def test_repack_bytes_name_the_types_the_tiles_read(pair):
    amx, vnni = pair
    rng = np.random.default_rng()
    for fmt in ("Q3_K", "Q6_K"):  # values past int8: they stay on AVX2
        raw = _raw(fmt, 20, 256, rng)
        p, _ = _struct(amx, fmt, [raw], 256, repack=False)
        assert amx.lib.ig_amx_repack_bytes(p) == 0
    raw = _raw("Q4_0", 20, 256, rng)
    p, _ = _struct(vnni, "Q4_0", [raw], 256, repack=False)
    assert vnni.lib.ig_amx_repack_bytes(p) == 0  # no tiles in the other builds


@pytest.mark.parametrize("fmt", TILE_TYPES)
def test_repacked_products_have_the_unrepacked_and_the_tiled_bits(pair, amx_rows, fmt):
    """Parts of 40 and 13 rows (a short strip), 512 wide, at 1-70 rows: the product from the copy equals
    the one that unpacks at every product and avx2vnni's tiled product bit for bit, decode (1-2 rows
    through AVX2 block sums from the stored bytes) and prefill alike, and numpy's float64 product."""
    amx, vnni = pair
    rng = np.random.default_rng()
    cols = 512
    raws = [_raw(fmt, 40, cols, rng), _raw(fmt, 13, cols, rng)]
    packed, _k1 = _struct(amx, fmt, raws, cols, repack=True)
    plain, _k2 = _struct(amx, fmt, raws, cols, repack=False)
    ref_parts, _k3 = _struct(vnni, fmt, raws, cols, repack=False)
    w = np.concatenate([np.asarray(dequantize(r, T[fmt]), np.float32).reshape(-1, cols) for r in raws])
    n = w.shape[0]
    for rows in (1, 2, 3, 4, 7, 8, 15, 16, 17, 33, 64, 70):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        xa, buf = _quantized_x(amx, x)
        xv, _ = _quantized_x(vnni, x)
        want = _product(vnni, vnni.lib.ig_matmul_tiled, ref_parts, xv, rows, n, 2, 2)
        for fn in (amx.lib.ig_matmul, amx.lib.ig_matmul_tiled):
            got = _product(amx, fn, packed, xa, rows, n, 2, 2)
            assert np.array_equal(got, want), (rows, fn)
            assert np.array_equal(got, _product(amx, fn, plain, xa, rows, n, 1, 2)), rows
        xd = (buf["d"][:, None] * buf["q"]).reshape(rows, cols)
        ref = xd.astype(np.float64) @ w.T.astype(np.float64)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    for buf in _k1:
        buf[:] = 0  # the tiles read the copy: zeroed, their products are zeros, the block sums' are not
    got = _product(amx, amx.lib.ig_matmul, packed, xa, rows, n, 2, 2)
    assert not got.any()
    assert np.array_equal(_product(amx, amx.lib.ig_matmul, packed, xa[0 : 2 * (cols // 32)], 2, n, 2, 2), want[:2])
    amx_rows(0)  # the other builds' decode path: the copy is not read
    x = rng.standard_normal((5, cols)).astype(np.float32)
    got = _product(amx, amx.lib.ig_matmul, packed, _quantized_x(amx, x)[0], 5, n, 2, 2)
    assert np.array_equal(got, _product(vnni, vnni.lib.ig_matmul, ref_parts, _quantized_x(vnni, x)[0], 5, n, 2, 2))


def _lanes_alone_and_together(cpu, prompts):
    """Eight lanes' decode logits together, and each lane's alone."""
    from engine.backend import PrefillSpan, StepOutput

    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(8)]
    for ids, table in zip(prompts, tables):
        cpu.prefill(PrefillSpan(0, ids[:-1], 0, table), StepOutput())
    batch = [DecodeLane(i, prompts[i][-1], len(prompts[i]) - 1, tables[i], GREEDY) for i in range(8)]
    return cpu.decode_logits(batch), [cpu.decode_logits([lane])[0] for lane in batch]


@pytest.mark.parametrize(
    "name", ["default", "tiny-Q4_K_M.gguf", "tiny-Q5_0.gguf", "tiny-Q5_1.gguf", "tiny-Q5_K_M.gguf"]
)
def test_a_lane_alone_and_beside_seven_with_the_copies(pair, name, monkeypatch):
    """The whole model under amx as stored, the copies made: a lane's logits are the same bits alone as
    beside 7 others (1 row through AVX2 block sums, 8 through the tiles from the copies), and the same
    as with no copies at all (the load's budget 0)."""
    from engine.backends.cpu import CpuBackend, model
    from engine.loaders.gguf import load_gguf
    from tests.engine.test_cpu_backend import DEFAULT_GGUF
    from tests.loaders.tiny_gguf import FIXTURES

    path = DEFAULT_GGUF if name == "default" else FIXTURES / name
    if not path.exists():
        pytest.skip(f"{path} not downloaded")
    cfg, stored = load_gguf(path, as_stored=CpuBackend.weights_as_stored)
    cpu = _load(CpuBackend(threads=2, isa="amx"), cfg, stored)
    assert cpu.model.repacked_bytes > 0
    rng = np.random.default_rng()
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (5, 17, 33, 2, 40, 9, 16, 25)]
    together, alone = _lanes_alone_and_together(cpu, prompts)
    assert all(np.array_equal(together[i], alone[i]) for i in range(8))
    monkeypatch.setattr(model, "repack_budget", lambda: 0)
    plain = _load(CpuBackend(threads=2, isa="amx"), cfg, stored)
    assert plain.model.repacked_bytes == 0
    assert np.array_equal(_lanes_alone_and_together(plain, prompts)[0], together)
