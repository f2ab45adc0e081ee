"""Kernels compiled alongside the weight upload (engine/cu/launch.py ``compiling``): inside the block
every module's nvcc run goes to a pool at once, the caller goes on, and ``bind`` loads the modules
and prepares their functions on the caller's thread. Runs without a card or PyCUDA: the compiler and
the driver's modules are tests/kernels/fake_nvcc.py (a run of the first N that does not find N
running together raises, so a serial path fails rather than hangs), the device fake_pycuda's.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections import Counter

import pytest

from engine.cu import hopper, launch
from engine.cu.kernels import Kernels
from tests.kernels import fake_nvcc

WORKERS = 4


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """A process's first load: no module compiled yet; hopper's parameter offsets packed in order
    (the fake cubins have no .nv.info sections)."""
    monkeypatch.setattr(launch, "_MODULES", {})

    def layout(cubin: bytes, name: str) -> list[tuple[int, int]]:
        out, off = [], 0
        codes = {"gemm_hopper": hopper.PARAMS, "prefill_attn_hopper_spans": hopper.FA_SPANS_PARAMS}
        for code in codes.get(name, hopper.FA_PARAMS):
            out.append((off, struct.calcsize(code)))
            off += struct.calcsize(code)
        return out

    monkeypatch.setattr(hopper, "param_layout", layout)


def _kernels(nvcc, cache, workers, formats=("Q8_0",)):
    """Kernels(128, 4) built in a ``compiling(workers)`` block: (kernels, the driver's calls, the
    modules loaded before ``bind``)."""
    with fake_nvcc.installed(nvcc) as calls:
        with launch.compiling(workers) as c:
            k = Kernels(128, 4, cache_dir=str(cache), formats=formats)
            before = list(calls.loads)
            c.bind()
    return k, calls, before


def _nvcc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nvcc")]


def test_the_compiles_run_at_once_and_nothing_loads_before_bind(tmp_path):
    nvcc = fake_nvcc.Nvcc(gate=WORKERS, timeout=10)
    k, calls, before = _kernels(nvcc, tmp_path, WORKERS)
    assert nvcc.most_running >= WORKERS
    assert before == []  # Kernels returned with every compile still on the pool
    assert len(calls.loads) == len(nvcc.runs) >= 12  # then each module loaded once
    assert isinstance(k._gemm.hopper._fns[(2, 256)], launch.LazyFunction) and k._gemm.hopper._fns[(2, 256)].target
    assert not _nvcc_threads()  # the pool ended with the block


def test_a_serial_compile_path_fails_the_gate(tmp_path):
    """The gate catches a path that compiles one module at a time (workers 0: the order before)."""
    with pytest.raises(RuntimeError, match="never ran at once"):
        _kernels(fake_nvcc.Nvcc(gate=2, timeout=0.5), tmp_path, 0)


def test_the_pool_compiles_what_the_serial_path_compiles(tmp_path):
    serial, parallel = fake_nvcc.Nvcc(), fake_nvcc.Nvcc(gate=WORKERS, timeout=10)
    _, s_calls, s_before = _kernels(serial, tmp_path / "serial", 0)
    _, p_calls, _ = _kernels(parallel, tmp_path / "parallel", WORKERS)
    assert len(s_before) == len(serial.runs)  # the serial path loaded each module as Kernels asked
    assert Counter(parallel.runs) == Counter(serial.runs) and len(set(parallel.runs)) == len(parallel.runs)
    assert len(set(serial.runs)) == len(serial.runs) >= 12  # each module once
    assert any("-DQTYPE=8" in opts for _, opts, _ in serial.runs)
    assert any(arch == "sm_90a" for _, _, arch in serial.runs)  # gemm_hopper's variants, prefill_attn_hopper
    # every function fetched, prepared and given its attributes as the serial path did
    assert Counter(c[:3] for c in p_calls.calls) == Counter(c[:3] for c in s_calls.calls)


def test_binding_happens_on_the_calling_thread(tmp_path):
    nvcc = fake_nvcc.Nvcc(gate=WORKERS, timeout=10)
    _, calls, _ = _kernels(nvcc, tmp_path, WORKERS)
    me = threading.get_ident()
    assert calls.loads and {t for _, t in calls.loads} == {me}
    assert calls.calls and {c[3] for c in calls.calls} == {me}
    assert nvcc.run_threads and me not in nvcc.run_threads


def test_a_launch_before_bind_binds_its_kernel_there(tmp_path):
    """The upload dequantizes a quantized tied embedding table with gemv_q's kernels before the load
    binds: that launch binds its function (on this thread) and replays what was recorded first."""
    with fake_nvcc.installed(fake_nvcc.Nvcc()) as calls:
        with launch.compiling(WORKERS) as c:
            k = Kernels(128, 4, cache_dir=str(tmp_path), formats=("Q8_0",))
            assert calls.loads == []
            k.quant("Q8_0").dequantize(None, 1 << 32, 2 << 32, 4, 256)
            fn = k.quant("Q8_0")._dequant["bf16"].fn
            assert not isinstance(fn, launch.LazyFunction)  # bound by the launch
            assert [c[1] for c in calls.calls if c[0] == fn.key] == ["get_function", "prepare", "launch"]
            assert len(calls.loads) == 1  # gemv_q's module alone
            c.bind()
    assert len(calls.loads) > 1


def test_a_compile_error_raises_from_the_block_and_ends_the_pool(tmp_path):
    nvcc = fake_nvcc.Nvcc(fail="decode_attn(")
    with pytest.raises(fake_nvcc.CompileError, match="decode_attn"):
        _kernels(nvcc, tmp_path, WORKERS)
    assert not _nvcc_threads()
    assert launch._MODULES and all(m.loaded for m in launch._MODULES.values())  # the failed one is not kept
    nvcc.fail = None
    _kernels(nvcc, tmp_path, WORKERS)  # asked again, it compiles again (no error kept)
    assert sum("decode_attn(" in src for src in nvcc.sources) == 2


def test_a_warm_cache_compiles_nothing(tmp_path, monkeypatch):
    cold = fake_nvcc.Nvcc(gate=WORKERS, timeout=10)
    _kernels(cold, tmp_path, WORKERS)
    monkeypatch.setattr(launch, "_MODULES", {})  # a new process, the same cache directory
    warm = fake_nvcc.Nvcc()
    _, calls, _ = _kernels(warm, tmp_path, WORKERS)
    assert warm.runs == [] and Counter(warm.hits) == Counter(cold.runs)
    assert len(calls.loads) == len(cold.runs)


def test_a_second_load_in_the_process_reuses_the_loaded_modules(tmp_path):
    nvcc = fake_nvcc.Nvcc()
    _, first, _ = _kernels(nvcc, tmp_path, WORKERS)
    runs = len(nvcc.runs)
    with fake_nvcc.installed(nvcc) as calls, launch.compiling(WORKERS) as c:
        k = Kernels(128, 4, cache_dir=str(tmp_path), formats=("Q8_0",))
        assert c.submitted == 0 and not isinstance(k._tc[("store", False)].fn, launch.LazyFunction)
    assert len(nvcc.runs) == runs and calls.loads == []


# --- through CudaBackend.load --------------------------------------------------------------------


@contextlib.contextmanager
def _backend_load(tmp_path, monkeypatch, nvcc, qtype="Q8_0", workers=WORKERS):
    """CudaBackend.load of the tiny GGUF (tests/loaders/tiny_gguf.py, ``qtype`` matrices) on the fake
    device with ``nvcc``, its graphs a stand-in that records the modules loaded at its capture."""
    pytest.importorskip("gguf")
    from engine.backends.cuda import graphs
    from engine.backends.cuda.backend import CudaBackend
    from engine.config import CudaTuning
    from engine.cu import runtime
    from engine.loaders import load_artifact
    from tests.loaders.tiny_gguf import write_quantized

    captured = []

    class Graphs:
        def __init__(self, *args, **kw) -> None:
            pass

        def capture(self) -> None:
            captured.append(len(calls.loads))

        def destroy(self) -> None:
            pass

    monkeypatch.setattr(graphs, "GraphRunner", Graphs)
    monkeypatch.setattr(runtime, "current", contextlib.nullcontext)
    cfg, weights = load_artifact(write_quantized(tmp_path / f"tiny-{qtype}.gguf", qtype), bf16_as_stored=True)
    be = CudaBackend(CudaTuning(kernel_cache_dir=str(tmp_path / "kernels")))
    be.compile_workers = workers
    with fake_nvcc.installed(nvcc) as calls:
        yield be, lambda: be.load(cfg, weights, block_size=16, kv_budget_bytes=1 << 20, host_kv_budget_bytes=0,
                                  max_context=64), calls, captured  # fmt: skip


def test_the_backend_binds_every_kernel_before_it_captures(tmp_path, monkeypatch):
    nvcc = fake_nvcc.Nvcc(gate=WORKERS, timeout=10)
    with _backend_load(tmp_path, monkeypatch, nvcc) as (be, load, calls, captured):
        load()
        assert captured == [len(nvcc.runs)] and nvcc.most_running >= WORKERS
        assert {t for _, t in calls.loads} == {threading.get_ident()}
    assert not _nvcc_threads()


def test_a_compile_error_fails_the_backend_load(tmp_path, monkeypatch):
    with _backend_load(tmp_path, monkeypatch, fake_nvcc.Nvcc(fail="decode_attn(")) as (be, load, calls, captured):
        with pytest.raises(fake_nvcc.CompileError):
            load()
        assert captured == [] and not be.mem  # unloaded: what the load took is freed
    assert not _nvcc_threads()


def test_a_block_inside_a_block_binds_its_own_and_leaves_the_outer_ones(tmp_path):
    nvcc = fake_nvcc.Nvcc()
    with fake_nvcc.installed(nvcc) as calls, launch.compiling(WORKERS) as outer:
        k = Kernels(128, 4, cache_dir=str(tmp_path), formats=())
        with launch.compiling(0):  # the serial order: compiled and loaded where asked
            launch.module("embed", (("X", 1),), str(tmp_path))
            assert len(calls.loads) == 1
        with launch.compiling(WORKERS):
            launch.module("embed", (("X", 2),), str(tmp_path)).get_function("embed")
        assert len(calls.loads) == 2 and launch._current() is outer
        assert isinstance(k._rmsnorm._fn, launch.LazyFunction) and k._rmsnorm._fn.target is None
    assert k._rmsnorm._fn.target is not None and launch._current() is None


@pytest.mark.parametrize("optin,built", [(232448, True), (101376, False)])
def test_the_paired_gemvs_are_built_only_where_their_shared_memory_fits(tmp_path, optin, built):
    """gemv_pair.cu's 64-row variant takes 128 KB of shared memory a block: on a card that gives a block
    less (most non-Hopper ones near 100 KB) the wide GEMVs stay gemv_tc's instead of failing the load."""
    nvcc = fake_nvcc.Nvcc()
    with fake_nvcc.installed(nvcc), launch.compiling(0):
        import pycuda.driver as drv

        drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = "optin"
        drv.Context.get_device().get_attribute = lambda attr: optin if attr == "optin" else 132
        k = Kernels(128, 4, cache_dir=str(tmp_path), formats=(), gemv_pair=True)
        assert bool(k._tcp) is built
