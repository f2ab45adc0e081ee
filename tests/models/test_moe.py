"""qwen3_moe and mixtral on the numpy backend against transformers, from safetensors (per-expert
and stacked experts) and from llama.cpp GGUFs; the router and expert reference against torch.

The tiny checkpoints have 8 experts, 2 chosen per token, random norm weights;
qwen3_moe's layer 1 is dense (``mlp_only_layers``); each family runs once with a
sliding window of 8 (qwen3_moe's also without ``norm_topk_prob``), once without.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from engine.backends.numpy import ops
from engine.backends.numpy.forward import _Experts
from engine.backends.numpy.linear import Linear
from engine.loaders import load_artifact
from engine.models import definition, for_gguf
from engine.models.ops import GatedMLP, MoE
from tests.engine.test_hf_parity import load_backend
from tests.models.test_qwen3 import assert_matches_hf
from tests.models.tiny_qwen import randomize_norms, write_gguf_twin

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.2)  # fmt: skip


def tiny(path, arch: str, **extra):
    """Write a tiny ``arch`` checkpoint with ``save_pretrained``; return transformers' model of it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], num_hidden_layers=3, head_dim=32, **COMMON, **extra,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=2, **COMMON, **extra)  # fmt: skip
        model = transformers.MixtralForCausalLM(cfg)
    randomize_norms(model)
    model.save_pretrained(path)
    return model.eval()


def assert_same_weights(weights: dict, expected: dict) -> None:
    assert set(weights) == set(expected)
    for name, w in expected.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob, window", [(True, None), (False, 8)])
def test_tiny_qwen3_moe_matches_hf(norm_topk_prob, window, tmp_path):
    hf = tiny(
        tmp_path, "qwen3_moe", norm_topk_prob=norm_topk_prob, use_sliding_window=bool(window), sliding_window=window
    )
    cfg, weights = load_artifact(tmp_path)
    d = definition(cfg.arch)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    blocks = d.blocks(cfg)
    assert [type(b.mlp) for b in blocks] == [MoE, GatedMLP, MoE]
    assert all(b.attention.sliding_window == window for b in blocks)  # qwen3_moe: every layer or none
    assert blocks[0].mlp == MoE(8, 2, norm_topk_prob=norm_topk_prob)
    assert {n: w.shape for n, w in weights.items()} == d.tensors(cfg)  # experts and the dense layer's MLP
    assert "model.layers.1.mlp.gate_proj.weight" in weights and "model.layers.1.mlp.gate.weight" not in weights
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 8])
def test_tiny_mixtral_matches_hf(window, tmp_path):
    hf = tiny(tmp_path, "mixtral", sliding_window=window)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in _names(tmp_path)  # the Hub's names on disk
    cfg, weights = load_artifact(tmp_path)
    d = definition(cfg.arch)
    assert (cfg.arch, cfg.rope_theta, cfg.sliding_window, cfg.layer_types) == ("mixtral", 1e6, window, ())
    assert all(b.mlp == MoE(8, 2) and b.attention.sliding_window == window for b in d.blocks(cfg))
    assert {n: w.shape for n, w in weights.items()} == d.tensors(cfg)
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_stacked_experts_split_into_the_per_expert_tensors(arch, tmp_path):
    """transformers 5's in-memory layout (router ``mlp.gate``, stacked ``mlp.experts.gate_up_proj`` /
    ``down_proj``) loads to the same tensors as the per-expert checkpoint it saves."""
    from safetensors.torch import save_file

    hf = tiny(tmp_path / "per_expert", arch)
    state = hf.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # [experts, 2 * inter, hidden]
    (tmp_path / "stacked").mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", tmp_path / "stacked" / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "stacked" / "model.safetensors")
    _, expected = load_artifact(tmp_path / "per_expert")
    _, weights = load_artifact(tmp_path / "stacked")
    assert_same_weights(weights, expected)


@pytest.mark.slow
def test_qwen3_moe_gguf_loads_as_its_hf_checkpoint(tmp_path):
    """llama.cpp's qwen3moe layout: router ffn_gate_inp, stacked ffn_*_exps (split as views),
    the dense layer's ffn_gate / ffn_up / ffn_down, expert_* metadata."""
    hf = tiny(tmp_path / "hf", "qwen3_moe", norm_topk_prob=True)
    write_gguf_twin(tmp_path / "hf", tmp_path / "tiny.gguf")
    hf_cfg, hf_weights = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert for_gguf("qwen3moe") is definition(cfg.arch)
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert cfg.params == hf_cfg.params == {"mlp_only_layers": (1,), "norm_topk_prob": True}
    assert_same_weights(weights, hf_weights)
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size, n_tokens=1)


@pytest.mark.slow
@pytest.mark.parametrize("stacked, window", [(True, 8), (False, None)])
def test_mixtral_gguf_is_a_llama_gguf_with_experts(stacked, window, tmp_path):
    """llama.cpp writes mixtral as arch "llama" (q/k rows permuted) with expert tensors, stacked
    ``ffn_*_exps`` or, in old files, ``ffn_*.{e}``, and a window as ``llama.attention.sliding_window``;
    it loads as mixtral, bit for bit."""
    hf = tiny(tmp_path / "hf", "mixtral", sliding_window=window)
    write_gguf_twin(tmp_path / "hf", tmp_path / "tiny.gguf", stacked=stacked)
    hf_cfg, hf_weights = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert (cfg.arch, cfg.sliding_window) == ("mixtral", window)
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert_same_weights(weights, hf_weights)
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size, n_tokens=1)


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


# --- config rules and refusals (no model run) ---------------------------------------------

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip
MIXTRAL = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def test_qwen3_moe_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    d = definition("qwen3_moe")
    sparse = [isinstance(b.mlp, MoE) for b in d.blocks(d.config_from_hf({**QWEN3_MOE, "decoder_sparse_step": 2}))]
    assert sparse == [False, True, False, True]  # transformers: (i + 1) % step == 0
    saved = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    cfg = d.config_from_hf({**saved, "mlp_only_layers": [0, 3], "num_local_experts": 4})
    assert [isinstance(b.mlp, MoE) for b in d.blocks(cfg)] == [False, True, True, False]
    assert cfg.num_experts == 4  # transformers 5 saves the count as num_local_experts
    assert d.config_from_hf({k: v for k, v in QWEN3_MOE.items() if k != "head_dim"}).head_dim == 16
    assert d.config_from_hf({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}).all_layers_slide
    m = definition("mixtral").config_from_hf(MIXTRAL)  # MixtralConfig's defaults: theta 1e6, 8 experts, top 2
    assert (m.rope_theta, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (1e6, 8, 2, 48)


def test_moe_definitions_refuse_what_they_do_not_support():
    q, m = definition("qwen3_moe"), definition("mixtral")
    with pytest.raises(ValueError, match="qwen3_moe: shared_expert_intermediate_size"):
        q.config_from_hf({**QWEN3_MOE, "shared_expert_intermediate_size": 128})
    with pytest.raises(ValueError, match="qwen3_moe: num_experts_per_tok 9 is not between 1 and num_experts"):
        q.config_from_hf({**QWEN3_MOE, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="qwen3_moe: hidden_act 'gelu'"):
        q.config_from_hf({**QWEN3_MOE, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="mixtral: hidden_act 'relu'"):
        m.config_from_hf({**MIXTRAL, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="mixtral: num_experts_per_tok 0"):
        m.config_from_hf({**MIXTRAL, "num_experts_per_tok": 0})
    meta = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.block_count": 2,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 96, "qwen3moe.expert_count": 8,
            "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}  # fmt: skip
    assert q.config_from_gguf(meta, set()).params["norm_topk_prob"]  # llama.cpp's qwen3moe graph renormalises
    with pytest.raises(ValueError, match="qwen3_moe: qwen3moe.expert_shared_count"):
        q.config_from_gguf({**meta, "qwen3moe.expert_shared_count": 1}, set())
    with pytest.raises(ValueError, match="qwen3_moe: qwen3moe.expert_gating_func 2"):
        q.config_from_gguf({**meta, "qwen3moe.expert_gating_func": 2}, set())
    llama = {k.replace("qwen3moe", "llama"): v for k, v in meta.items()} | {"general.architecture": "llama"}
    names = {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate.weight"}
    with pytest.raises(ValueError, match=r"mixtral: blk.1.ffn_gate_inp.weight missing"):
        for_gguf("llama").config_from_gguf(llama, names)
    assert for_gguf("llama").config_from_gguf({**llama, "llama.expert_count": 0}, names).arch == "llama"


def test_expert_tensors_of_the_wrong_shape_are_refused():
    d = definition("qwen3_moe")
    cfg = d.config_from_hf(QWEN3_MOE)
    with pytest.raises(ValueError, match=r"blk.0.ffn_up_exps.weight: shape \(8, 64, 32\), expected \(8, 32, 64\)"):
        list(d.from_gguf(cfg, "blk.0.ffn_up_exps.weight", np.zeros((8, 64, 32), np.float32)))
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj: shape \(8, 32, 64\), expected \(8, 64, 64\)"):
        d.from_hf(cfg, {"model.layers.0.mlp.experts.gate_up_proj": np.zeros((8, 32, 64), np.float32)})
    stacked = np.random.default_rng(0).normal(size=(8, 64, 32)).astype(np.float32)
    parts = dict(d.from_gguf(cfg, "blk.2.ffn_down_exps.weight", stacked))
    assert list(parts) == [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(8)]
    assert all(np.shares_memory(p, stacked) for p in parts.values())  # views, no copy


# --- the router and expert reference against a direct torch computation ------------------


def test_route_matches_torch_topk_and_breaks_ties_by_lower_id():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(0).normal(0, 2, (64, 8)).astype(np.float32)
    for normalize in (True, False):
        ids, w = ops.route(logits, 3, normalize)
        p = torch.softmax(torch.from_numpy(logits), dim=-1)
        top, top_ids = torch.topk(p, 3, dim=-1)
        if normalize:
            top = top / top.sum(-1, keepdim=True)
        np.testing.assert_array_equal(ids, top_ids.numpy())
        np.testing.assert_allclose(w, top.numpy(), rtol=1e-6)
    assert abs(ops.route(logits, 3, False)[1].sum(-1) - 1).min() > 1e-3  # unnormalised: not summing to 1
    ids, w = ops.route(np.array([[0.0, 2.0, 1.0, 2.0, 2.0]], np.float32), 2, True)
    assert ids.tolist() == [[1, 3]] and np.allclose(w, 0.5)


@pytest.mark.parametrize("norm, biases", [(True, False), (False, False), (True, True)])
def test_moe_matches_a_per_token_torch_computation(norm, biases):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    n, h, inter, e, k = 13, 24, 16, 6, 2

    def rand(*shape):
        return rng.normal(0, 0.5, shape).astype(np.float32)

    x, router, gate, up, down = rand(n, h), rand(e, h), rand(e, inter, h), rand(e, inter, h), rand(e, h, inter)
    rb, gb, ub, db = rand(e), rand(e, inter), rand(e, inter), rand(e, h)
    layer = _Experts(
        op=MoE(e, k, norm_topk_prob=norm, router_bias=biases, expert_bias=biases),
        router=Linear(router), router_bias=rb if biases else None,
        gate_up=[Linear(np.concatenate([gate[j], up[j]])) for j in range(e)],
        gate_up_bias=[np.concatenate([gb[j], ub[j]]) if biases else None for j in range(e)],
        down=[Linear(down[j]) for j in range(e)], down_bias=[db[j] if biases else None for j in range(e)],
    )  # fmt: skip
    ours = ops.moe(x, layer)

    t = {name: torch.from_numpy(a).double() for name, a in dict(x=x, r=router, g=gate, u=up, d=down,
                                                                 rb=rb, gb=gb, ub=ub, db=db).items()}  # fmt: skip
    on = 1.0 if biases else 0.0
    ref = torch.zeros(n, h, dtype=torch.float64)
    for row in range(n):
        p = torch.softmax(t["r"] @ t["x"][row] + on * t["rb"], dim=-1)
        top, top_ids = torch.topk(p, k)
        if norm:
            top = top / top.sum()
        for weight, j in zip(top, top_ids.tolist()):
            g = t["g"][j] @ t["x"][row] + on * t["gb"][j]
            u = t["u"][j] @ t["x"][row] + on * t["ub"][j]
            ref[row] += weight * (t["d"][j] @ (torch.nn.functional.silu(g) * u) + on * t["db"][j])
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-5, atol=1e-5)
