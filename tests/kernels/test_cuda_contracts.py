"""What the CUDA backend checks before anything reaches a device: each kernel's declared
parameters at launch, and the model definition's operations at load. Runs without a GPU."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest

from engine.backends.cuda.forward import check_model, check_supported
from engine.cu.launch import TYPES, Kernel
from engine.models import definition
from engine.models.ops import Attention, Embedding, GatedMLP, MoE, QKNorm, RMSNorm, Rope


class _Fn:
    def __init__(self) -> None:
        self.prepared, self.calls = None, []

    def prepare(self, arg_types: str) -> None:
        self.prepared = arg_types

    def prepared_async_call(self, grid, block, stream, *args, shared_size=0) -> None:
        self.calls.append((grid, block, args, shared_size))


class _Module:
    def __init__(self) -> None:
        self.fn = _Fn()

    def get_function(self, name: str) -> _Fn:
        return self.fn


def _kernel(params="x:ptr n:i32 eps:f32 stride:i64", threads=256):
    mod = _Module()
    return Kernel(mod, "k", params, threads), mod.fn


def test_kernel_prepares_from_its_declaration_and_converts_by_name():
    k, fn = _kernel()
    assert fn.prepared == "Pifq"
    k("stream", (3,), eps=1e-5, stride=1 << 40, n=7, x=4096)
    grid, block, args, _ = fn.calls[0]
    assert grid == (3, 1, 1) and block == (256, 1, 1)
    assert args == (4096, np.int32(7), np.float32(1e-5), np.int64(1 << 40))
    # PyCUDA packs them with the prepared format: the bytes of the C types, as numpy's scalars give
    assert struct.pack(fn.prepared, *args) == struct.pack("Pifq", 4096, np.int32(7), np.float32(1e-5), 1 << 40)


@pytest.mark.parametrize(
    "values",
    [
        dict(x=np.uint64(4096), n=np.int64(7), eps=np.float32(0.1), stride=np.int32(3)),
        dict(x=4096, n=True, eps=0.1, stride=3),
        dict(x=4096, n=-(1 << 31), eps=3, stride=-(1 << 63)),
        dict(x=(1 << 64) - 1, n=(1 << 31) - 1, eps=float("inf"), stride=(1 << 63) - 1),
    ],
)
def test_a_launch_packs_what_the_checked_conversions_give(values):
    """Plain ints and floats go to the launch as they are, anything else through TYPES' conversions:
    either way the packed bytes are those of the declared C types."""
    k, fn = _kernel()
    k("stream", (1,), **values)
    converted = [TYPES[t][1](values[n]) for n, t in k.params]
    assert struct.pack(fn.prepared, *fn.calls[0][2]) == struct.pack(fn.prepared, *converted)


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(x=1, n=2, eps=0.1), "missing parameter 'stride'"),
        (dict(x=1, n=2, eps=0.1, stride=3, extra=4), "unknown parameters ['extra']"),
        (dict(x=1, n=2.5, eps=0.1, stride=3), "parameter 'n'"),
        (dict(x=1, n=1 << 40, eps=0.1, stride=3), "parameter 'n'"),
        (dict(x=1, n=2, eps="a", stride=3), "parameter 'eps'"),
        (dict(x=-1, n=2, eps=0.1, stride=3), "parameter 'x'"),
        (dict(x=1, n=2, eps=0.1, stride=1 << 63), "parameter 'stride'"),
        (dict(x=1, n=-(1 << 31) - 1, eps=0.1, stride=3), "parameter 'n'"),
    ],
)
def test_kernel_refuses_a_wrong_launch(values, message):
    k, fn = _kernel()
    with pytest.raises(TypeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        k("stream", (1,), **values)
    assert not fn.calls


def test_kernel_refuses_an_unknown_type():
    with pytest.raises(ValueError, match="unknown parameter types"):
        _kernel("x:ptr n:u8")


def _cfg():
    from engine.model_config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position=256, tie_word_embeddings=True, attention_bias=False)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_the_registered_definitions_are_supported(arch):
    d = definition(arch)
    check_supported(d.block(_cfg(), 0), d.head(_cfg()))


@pytest.mark.parametrize(
    "change",
    [
        lambda b, h: (replace(b, mlp_norm=RMSNorm("post_attention_layernorm", plus_one=True)), h),
        lambda b, h: (b, replace(h, final_norm=RMSNorm("model.norm", plus_one=True), softcap=30.0)),
        lambda b, h: (replace(b, attention=replace(b.attention, rope=None)), h),
        lambda b, h: (
            replace(
                b,
                attention=Attention(
                    Rope(theta=1e6, rotary_dim=32),
                    qk_norm=QKNorm(plus_one=True),
                    scale=0.1,
                    softcap=50.0,
                    sliding_window=512,
                    sinks=True,
                    o_bias=True,
                ),
            ),
            h,
        ),  # fmt: skip
        lambda b, h: (
            replace(b, mlp=GatedMLP("gelu_tanh"), attn_post_norm=RMSNorm("a"), mlp_post_norm=RMSNorm("b")),
            h,
        ),
    ],
)
def test_the_new_operations_are_supported(change):
    d = definition("llama")
    block, head = change(d.block(_cfg(), 0), d.head(_cfg()))
    check_supported(block, head)
    check_model([d.block(_cfg(), 0), block], head, Embedding(8.0))  # layers may differ


@pytest.mark.parametrize(
    "change,named",
    [
        (lambda b, h: (replace(b, attention=replace(b.attention, rope=Rope("gptj"))), h), "rope"),
        (lambda b, h: (replace(b, attention=replace(b.attention, rope=Rope(rotary_dim=24))), h), "rotary_dim"),
        (lambda b, h: (replace(b, attention=replace(b.attention, sliding_window=0)), h), "sliding_window"),
        (lambda b, h: (replace(b, mlp=GatedMLP("gelu")), h), "block.mlp"),
        (lambda b, h: (replace(b, mlp=MoE(num_experts=4, top_k=2, act="gelu")), h), "MoE act"),
        (lambda b, h: (replace(b, residual="sandwich"), h), "residual"),
    ],
)
def test_an_operation_without_kernels_is_refused_by_name(change, named):
    d = definition("llama")
    block, head = change(d.block(_cfg(), 0), d.head(_cfg()))
    with pytest.raises(ValueError, match=named):
        check_supported(block, head)
    with pytest.raises(ValueError, match=f"layer 1: .*{named}"):
        check_model([d.block(_cfg(), 0), block], head, Embedding())


def test_partial_rotary_interleaves_only_the_rotated_dims():
    """``interleave_rope`` with rotary_dim R: each head's first R rows in the 8-row pair groups the
    rope epilogue reads, the rest in place; R = head_dim is the full interleave, R = 0 none."""
    from engine.backends.cuda.weights import interleave_rope

    w = np.arange(2 * 64, dtype=np.float32)[:, None]
    full = interleave_rope(w, 64).ravel()
    assert full[:24].tolist() == [*range(8), *range(32, 40), *range(8, 16)]
    part = interleave_rope(w, 64, 32).ravel()
    assert part[:32].tolist() == [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert part[32:64].tolist() == list(range(32, 64)) and part[64:80].tolist() == [*range(64, 72), *range(80, 88)]
    assert (interleave_rope(w, 64, 0) == w).all()
    with pytest.raises(ValueError, match="multiples of 16"):
        interleave_rope(w, 64, 24)


def test_attention_scales():
    """The attention kernels' score multipliers: scale * log2(e), or with a soft-cap scale / cap and cap * log2(e)."""
    from engine.cu.kernels import attention_scales

    assert attention_scales(64, None, None) == (np.float32(0.125 * np.log2(np.e)), 0.0)
    s, c = attention_scales(128, 0.1, 50.0)
    assert np.isclose(s, 0.1 / 50.0) and np.isclose(c, 50.0 * np.log2(np.e))


def test_a_model_mixing_dense_and_sparse_layers_is_refused_by_name():
    from engine.backends.cuda.forward import check_model

    d = definition("llama")
    dense = d.block(_cfg(), 0)
    sparse = replace(dense, mlp=MoE(num_experts=4, top_k=2))
    check_model([sparse, sparse], d.head(_cfg()), Embedding())
    with pytest.raises(ValueError, match="every layer is sparse"):
        check_model([sparse, dense], d.head(_cfg()), Embedding())
