"""The model's weights on the device, in the layouts the kernels read.

bf16 (biases fp32), torch ``[out, in]``. q|k|v are fused into one matrix with each
head's rows rope-interleaved in 8-row groups (``interleave_rope``) and gate|up into one
matrix interleaved in 8-row groups (``interleave_gate_up``; plain gate-then-up when
I % 8 != 0), so a decode GEMV block holds both members of its rope pairs or matching
gate and up rows and applies rope or SwiGLU in its epilogue. A tied LM head is the
embedding. Weights arrive as the interface says: canonical (HF llama) names, float32
numpy arrays; torch tensors are accepted too (already-on-GPU ones are copied device
to device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model_config import ModelConfig
from engine.models.ops import Block, Head


@dataclass
class Layer:
    """Device addresses of one decoder layer's tensors."""

    ln1: int
    ln2: int
    qkv: int
    qkv_bias: int  # 0 when the model has none
    o: int
    gate_up: int
    down: int


@dataclass
class DeviceWeights:
    embed: int
    lm_head: int
    final_norm: int
    inv_freq: int  # fp32 [head_dim / 2], rope frequencies with the model's scaling
    layers: list[Layer]
    gate_up_interleaved: bool
    nbytes: int  # weight bytes uploaded (a tied head counts once)


def upload(cfg: ModelConfig, block: Block, head: Head, weights, mem) -> DeviceWeights:
    """Copy ``weights`` to the device through ``mem`` (``runtime.Allocations``); the norms' tensor
    names and whether q|k|v carry biases come from the definition's ``block`` and ``head``."""
    from engine.models.rope import rope_inv_freq, rope_tables

    if rope_tables(cfg, block.attention.rope)[1] != 1.0:  # longrope / yarn scale cos and sin too
        raise ValueError("the CUDA backend has no kernel for a rope attention factor (longrope, yarn)")
    import pycuda.driver as cuda

    up = _Uploader(weights, mem)
    d = cfg.head_dim
    interleaved = cfg.intermediate_size % 8 == 0
    embed = up(["model.embed_tokens.weight"])
    lm_head = embed if cfg.tie_word_embeddings else up(["lm_head.weight"])
    final_norm = up([head.final_norm.weight + ".weight"])
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        proj = [p + f"self_attn.{x}_proj." for x in "qkv"]
        layers.append(
            Layer(
                ln1=up([p + block.attn_norm.weight + ".weight"]),
                ln2=up([p + block.mlp_norm.weight + ".weight"]),
                qkv=up([x + "weight" for x in proj], rope_dim=d),
                qkv_bias=up([x + "bias" for x in proj], fp32=True, rope_dim=d) if block.attention.qkv_bias else 0,
                o=up([p + "self_attn.o_proj.weight"]),
                gate_up=up([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], interleave=interleaved),
                down=up([p + "mlp.down_proj.weight"]),
            )
        )
    inv = np.ascontiguousarray(rope_inv_freq(cfg), dtype=np.float32)
    inv_freq = mem.alloc(inv.nbytes)
    cuda.memcpy_htod(inv_freq, inv)
    return DeviceWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, inv_freq=inv_freq, layers=layers,
                         gate_up_interleaved=interleaved, nbytes=up.nbytes)  # fmt: skip


class _Uploader:
    def __init__(self, weights, mem) -> None:
        self.weights, self.mem, self.nbytes = weights, mem, 0

    def __call__(self, names: list[str], fp32: bool = False, interleave: bool = False, rope_dim: int = 0) -> int:
        """Upload tensors ``names`` concatenated along dim 0 as bf16 (fp32 for biases); with
        ``interleave`` the two (gate, up) are interleaved in 8-row groups instead; with ``rope_dim``
        each part's heads are rope-interleaved."""
        import pycuda.driver as cuda

        parts = [self.weights[n] for n in names]
        if rope_dim:
            parts = [interleave_rope(p, rope_dim) for p in parts]
        if interleave:
            parts = [interleave_gate_up(*parts)]
        nbytes = sum(int(np.prod(p.shape)) for p in parts) * (4 if fp32 else 2)
        dst = self.mem.alloc(nbytes)
        self.nbytes += nbytes
        off = 0
        for p in parts:
            if _is_torch(p):
                import torch

                t = p.detach().to(torch.float32 if fp32 else torch.bfloat16).contiguous()
                if t.is_cuda:
                    torch.cuda.synchronize()
                    cuda.memcpy_dtod(dst + off, t.data_ptr(), t.numel() * t.element_size())
                else:
                    cuda.memcpy_htod(dst + off, t.view(torch.int32 if fp32 else torch.int16).numpy())
                off += t.numel() * t.element_size()
            else:
                a = np.ascontiguousarray(p, dtype=np.float32) if fp32 else to_bf16(p)
                cuda.memcpy_htod(dst + off, a)
                off += a.nbytes
        return dst


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def interleave_gate_up(gate, up):
    """[I, K] gate and up -> [2I, K] in 8-row groups (gate 8j..8j+7, then up 8j..8j+7), the layout
    ``Kernels.gate_up_act`` and ``swiglu(interleaved=True)`` read. Works on numpy arrays and torch tensors."""
    i, k = gate.shape
    if _is_torch(gate):
        import torch

        return torch.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)
    return np.stack([gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)], 1).reshape(2 * i, k)


def interleave_rope(w, head_dim: int):
    """Rows (dim 0) of stacked heads of ``head_dim`` -> each head in the rope-interleaved order
    gemv_tc_rope and ``rope_kv_write(interleaved=True)`` read: position 16j + r holds dim 8j + r,
    position 16j + 8 + r dim head_dim/2 + 8j + r. Works on numpy arrays and torch tensors (weights
    [rows, K] or biases [rows])."""
    n, rest = w.shape[0], tuple(w.shape[1:])
    if head_dim % 16 or n % head_dim:
        raise ValueError(f"{n} rows are not whole heads of {head_dim} (a multiple of 16)")
    v = w.reshape((n // head_dim, 2, head_dim // 16, 8) + rest)
    return (v.transpose(1, 2) if _is_torch(w) else v.swapaxes(1, 2)).reshape(w.shape)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
