"""Programmatic dependent launch (``cuda.pdl``, engine/cu/launch.py, common.cuh's pdl_wait): a decode
round's kernels may start while the kernel before them ends, and must read nothing it writes
before their wait. On the GPU: the round's tokens and logits with it on are bit for bit those with
it off (a llama of the Llama-3.1-8B shape with two layers, a small qwen2; widths 1, 3, 8, greedy
and seeded), and the captured graphs hold the programmatic edges. Here: the launch's parameter
slots and config, the key, and that every kernel of a PDL source waits."""

from __future__ import annotations

import ctypes
import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from engine.cu import launch
from engine.cu.kernels import PDL_SOURCES
from tests.kernels.gpu import gpu

# --- anywhere -----------------------------------------------------------------------------


def test_param_slots_hold_each_value_as_the_kernel_reads_it():
    types = ("ptr", "i32", "i64", "f32", "i32")
    slots = launch.ParamSlots(types)
    conv = [launch.TYPES[t][1] for t in types]
    values = [0x7F12_3456_7800, -3, 1 << 40, 0.1, 2**31 - 1]
    address = slots.fill([c(v) for c, v in zip(conv, values)])
    assert address == slots.address == ctypes.addressof(slots.array)
    want = [np.uint64(values[0]), np.int32(-3), np.int64(1 << 40), np.float32(0.1), np.int32(2**31 - 1)]
    for i, (slot, w) in enumerate(zip(slots.slots, want)):
        assert bytes(slot) == w.tobytes(), i  # the bytes prepare()'s "PiqfI" struct would pass
        assert slots.array[i] == ctypes.addressof(slot)  # void* kernelParams[i] -> the value
    slots.fill([c(v) for c, v in zip(conv, [1, 2, 3, 4.5, 5])])  # reused: the driver copied the last launch's
    assert bytes(slots.slots[3]) == np.float32(4.5).tobytes()
    with pytest.raises(ValueError):
        slots.fill([1, 2])  # a launch's values are all its parameters


def _fake_driver():
    class Obj:
        pass

    class Attribute:
        def __init__(self) -> None:
            self.id, self.value = None, SimpleNamespace()

    ids = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION="PSS")
    return SimpleNamespace(CUlaunchConfig=Obj, CUlaunchAttribute=Attribute, CUlaunchAttributeID=ids,
                           CUstream=lambda h: ("stream", h))  # fmt: skip


def test_launch_config_asks_for_programmatic_stream_serialization():
    drv = _fake_driver()
    cfg = launch.launch_config(drv, (384, 2, 1), (256, 1, 1), 4096, 0xABC)
    grid = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ)
    assert grid == (384, 2, 1) and (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (256, 1, 1)
    assert cfg.sharedMemBytes == 4096 and cfg.hStream == ("stream", 0xABC)
    assert cfg.numAttrs == 1 and cfg.attrs[0].id == "PSS"
    assert cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1
    plain = launch.launch_config(drv, (1, 1, 1), (128, 1, 1), 0, 1, pdl=False)
    assert plain.numAttrs == 0 and plain.attrs == []


def test_a_kernel_of_a_pdl_module_launches_through_the_driver():
    mod = launch.PdlModule.__new__(launch.PdlModule)  # no device: the handle is never used here
    mod.get_function = lambda name: f"CUfunction {name}"
    k = launch.Kernel(mod, "embed", "tokens:ptr H:i32 scale:f32", 128)
    assert k.pdl and k.fn == "CUfunction embed" and len(k._slots.slots) == 3


def test_pdl_builds_define_pdl_and_plain_builds_do_not(tmp_path):
    _, plain, _ = launch._build("embed", (("X", 2),), str(tmp_path))
    _, pdl, _ = launch._build("embed", (("X", 2), ("PDL", 1)), str(tmp_path))
    assert "-DX=2" in plain and not any("PDL" in o for o in plain)
    assert pdl[-1] == "-DPDL=1"


def test_every_kernel_of_a_pdl_source_waits_for_the_kernel_before():
    """A kernel launched with PDL that reads its inputs without pdl_wait() would race the kernel before
    it (and a kernel that never waits could complete before that one, breaking the chain)."""
    for name in sorted(PDL_SOURCES):
        src = (launch.CU_DIR / f"{name}.cu").read_text()
        bodies = re.split(r'extern "C" __global__', src)[1:]
        assert bodies, name
        for body in bodies:
            fn = re.search(r"\b(\w+)\s*\(", body.split("{", 1)[0].replace("__launch_bounds__", "")).group(1)
            assert "pdl_wait()" in body or "gemv_tc_body" in body, f"{name}.cu {fn}: no pdl_wait()"
    main = (launch.CU_DIR / "gemv.cu").read_text().split("gemv_tc_main", 1)[1].split("gemv_tc_epilogue", 1)[0]
    assert main.count("pdl_wait()") == 2  # after the first weight batch, and for a warp with no step
    common = (launch.CU_DIR / "common.cuh").read_text()
    assert "griddepcontrol.wait" in common and "griddepcontrol.launch_dependents" in common


def test_cuda_pdl_key_reaches_cuda_tuning():
    from engine.config import CudaTuning
    from ignis_site import config

    assert config.FIELDS["cuda.pdl"].default is False and CudaTuning().pdl is False
    values, _ = config.resolve(environ={"IGNIS_CUDA_PDL": "on"})
    assert config.cuda_tuning_dict(values)["pdl"] is True
    assert CudaTuning(**config.cuda_tuning_dict(values)).pdl is True


# --- on the GPU ---------------------------------------------------------------------------

STEPS = 6


def _load(arch: str, rope: dict, shape: dict):
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.models import definition
    from tests.kernels.hf_models import random_model

    model, cfg = random_model(arch, rope, dtype="bfloat16", **shape)
    sd = model.state_dict()
    weights = {n: sd[n] for n in definition(cfg.arch).tensors(cfg)}
    be = CudaBackend(CudaTuning())
    be.load(cfg, weights, block_size=16, kv_budget_bytes=1 << 30, host_kv_budget_bytes=0, max_context=4096)
    del model, sd, weights
    return be, cfg


@pytest.fixture(scope="module", params=["llama8b", "qwen2"])
def backend(request):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.kernels.hf_models import DEFAULT_ROPE, LLAMA3_ROPE, LLAMA8B, QWEN_SMALL

    if request.param == "llama8b":
        be, cfg = _load("llama", LLAMA3_ROPE, dict(LLAMA8B, num_hidden_layers=2))
    else:
        be, cfg = _load("qwen2", DEFAULT_ROPE, QWEN_SMALL)
    yield be, cfg
    be.unload()


def _set_pdl(be, on: bool) -> None:
    be.retune(replace(be.tuning, pdl=on))  # new Kernels, graphs recaptured
    assert be.kern.pdl is on, "CudaBackend._kernels() must pass pdl=self.tuning.pdl to Kernels"
    assert not be.graphs.eager and set(be.graphs.graphs) == set(range(1, be.max_round_rows + 1))


def _rounds(be, cfg, width: int, params) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill ``width`` prompts, then STEPS decode rounds of them all: every lane's tokens and each
    round's logits (read back: the rows ask for logprobs). Every run rewrites the KV it reads."""
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput

    rng = np.random.default_rng(width)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 90))).tolist() for _ in range(width)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(width)]
    seqs, logits = [], []
    for i, p in enumerate(prompts):
        out = StepOutput()
        req = SampleRequest(params=params, seed=11 + i, want_logprobs=True)
        be.prefill(PrefillSpan(seq_id=i, token_ids=p, start_pos=0, block_table=tables[i], sample=req), out)
        seqs.append([out.prefill_token])
    for _ in range(STEPS):
        lanes = [DecodeLane(seq_id=i, token_id=seqs[i][-1], position=len(prompts[i]) + len(seqs[i]) - 1,
                            block_table=tables[i], sample=SampleRequest(params=params, seed=11 + i,
                                                                        want_logprobs=True))
                 for i in range(width)]  # fmt: skip
        out = StepOutput()
        be.decode_round(lanes, out)
        logits.append(be.logits_host[:width].copy())
        for i, t in enumerate(out.decode_tokens):
            seqs[i].append(t)
    return seqs, logits


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_decode_rounds_are_bitwise_the_same_with_pdl(backend, width, sampling):
    from engine.sampling import SamplingParams

    be, cfg = backend
    params = SamplingParams(temperature=0.0) if sampling == "greedy" else SamplingParams(temperature=0.8, top_p=0.9)
    runs = {}
    for on in (False, True):
        _set_pdl(be, on)
        runs[on] = _rounds(be, cfg, width, params)
    _set_pdl(be, False)
    (tok_off, log_off), (tok_on, log_on) = runs[False], runs[True]
    assert tok_on == tok_off
    for r, (a, b) in enumerate(zip(log_off, log_on)):
        assert np.array_equal(a, b), f"round {r}: logits differ at {np.argwhere(a != b)[:4].tolist()}"


def _edge_types(graph) -> list:
    """The dependency type of every edge of a captured graph (cuda.bindings' edge data)."""
    from cuda.bindings import driver as drv

    get = getattr(drv, "cuGraphGetEdges_v2", None) or drv.cuGraphGetEdges
    n = int(get(graph, 0)[-1])
    res = get(graph, n)
    assert res[0] == drv.CUresult.CUDA_SUCCESS, res[0]
    data = next((r for r in res[1:] if isinstance(r, list) and r and hasattr(r[0], "type")), None)
    assert data is not None, f"no edge data in {type(get).__name__}'s result: {[type(r) for r in res]}"
    return [d.type for d in data]


@gpu
@pytest.mark.slow
def test_captured_graphs_keep_programmatic_edges(backend):
    from cuda.bindings import driver as drv

    be, _ = backend
    programmatic = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    counts = {}
    for on in (False, True):
        _set_pdl(be, on)
        counts[on] = {w: _edge_types(be.graphs.graphs[w].graph).count(programmatic) for w in (1, 8)}
    _set_pdl(be, False)
    assert counts[False] == {1: 0, 8: 0}
    nodes = be.graphs.num_nodes(1)
    assert all(c >= nodes // 2 for c in counts[True].values()), (counts, nodes)  # most launches follow a kernel
