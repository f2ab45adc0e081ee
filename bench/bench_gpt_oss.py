"""gpt-oss-20b's shape on the CUDA backend, its experts in MXFP4 as stored (issue 14 point 3): the
whole model's decode round and prefill, where bench/bench_moe_mx.py times the MoE layers alone.

The model is built from the gpt_oss definition (``config_from_hf`` of gpt-oss-20b's config.json
fields: 24 layers alternating sliding-window 128 and full attention with sinks, 64 query heads of 64
over 8 KV heads, 32 experts of 2,880 a layer, 4 a token, a 201,088-token vocabulary), with random
weights: bf16 on the GPU for attention, norms, embedding and head, host float32 for the routers and
expert biases, and the expert matrices as ``Mxfp4Tensor``, as the loader hands them over (random
codes, scales 2^-8 .. 2^-4; one host pool of codes shared by every expert, so host memory stays small). ``--bf16`` loads a second model in the same run with the same
shapes' experts as bf16 (38 GB more on the card: an H200, not an H100).

Timed as bench/bench_cuda.py times the Llama shape: prefill of each ``--prompts`` length (wall time of
``prefill``), the decode round's wall time at widths 1, 2, 4 and 8 (512-token contexts), the decode
graph alone, and rounds planned ahead; the width-1 bound counts the bytes one token's round must read
(every tensor but the embedding and the experts, bf16, plus 4 experts a layer as stored) at the
measured read bandwidth.

    python3 bench/bench_gpt_oss.py [--bf16] [--prompts 16 512 2048] [--write]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## gpt-oss-20b with MXFP4 experts on the CUDA backend (H200, issue 14)"
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, attention_bias=True, tie_word_embeddings=False,
                   rms_norm_eps=1e-5, max_position_embeddings=131072, swiglu_limit=7.0)  # fmt: skip
SCALES = (119, 124)  # e8m0 bytes drawn from [119, 124): 2^-8 .. 2^-4


def is_expert_matrix(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def mxfp4_experts(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict:
    """An ``Mxfp4Tensor`` for every expert matrix of ``shapes`` (a definition's ``tensors(cfg)``): random
    codes and scales, one pool a matrix shape, shared (views) by every expert of that shape."""
    from engine.loaders.mxfp4 import Mxfp4Tensor

    rng, pools, out = np.random.default_rng(seed), {}, {}
    for name, shape in shapes.items():
        if not is_expert_matrix(name):
            continue
        if shape not in pools:
            rows, g = shape[0], shape[1] // 32
            pools[shape] = Mxfp4Tensor(rng.integers(0, 256, (rows, g, 16), dtype=np.uint8),
                                       rng.integers(*SCALES, (rows, g), dtype=np.uint8))  # fmt: skip
        out[name] = pools[shape]
    return out


def device_weights(shapes: dict[str, tuple[int, ...]], torch, experts_bf16: bool) -> dict:
    """Random tensors for every name of ``shapes`` but the expert matrices (all of them too with
    ``experts_bf16``): matrices scaled by 1 / sqrt(fan-in), fp32 biases and sinks, norms near 1. bf16
    on the GPU, except the MoE layers' (router, biases, experts), which the expert upload reads as
    host float32 (``upload_moe``): those from numpy, an expert matrix one pool a shape (views)."""
    g, rng = torch.Generator(device="cuda").manual_seed(0), np.random.default_rng(1)
    out, pools = {}, {}
    for name, shape in shapes.items():
        if is_expert_matrix(name):
            if experts_bf16:
                if shape not in pools:
                    pools[shape] = (rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5).astype(np.float32)
                out[name] = pools[shape]
        elif ".mlp." in name:
            a = rng.standard_normal(shape, np.float32)
            out[name] = a * (shape[-1] ** -0.5 if len(shape) >= 2 else 0.1)
        elif len(shape) >= 2:
            out[name] = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * (shape[-1] ** -0.5)
        elif name.endswith(".bias") or name.endswith(".sinks"):
            out[name] = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.1
        else:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
    return out


def bound_bytes(shapes: dict[str, tuple[int, ...]], cfg, expert_bytes: int) -> int:
    """Bytes a one-token round reads: every tensor but the embedding and the experts as bf16, plus
    ``num_experts_per_tok`` experts a layer of ``expert_bytes`` each."""
    n = sum(int(np.prod(s)) for name, s in shapes.items()
            if name != "model.embed_tokens.weight" and ".mlp.experts." not in name)  # fmt: skip
    return 2 * n + cfg.num_layers * cfg.num_experts_per_tok * expert_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="*", default=[16, 512, 2048], help="prefill lengths")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=24, help="fewer layers for a quick look")
    ap.add_argument("--bf16", action="store_true", help="also the same model with bf16 experts")
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    args = ap.parse_args()

    import pycuda.driver as cuda
    import torch

    from bench.bench_cuda import WIDTHS, bench_ignis, read_bandwidth
    from bench.perfdoc import command_line, report
    from engine.backends.cuda import CudaBackend
    from engine.backends.cuda.moe import expert_bytes
    from engine.cu import runtime
    from engine.models import for_hf

    torch.cuda.init()
    with runtime.current():
        bw = read_bandwidth(cuda, cuda.Stream())
    d = for_hf("gpt_oss")
    cfg = d.config_from_hf({"model_type": "gpt_oss", **dict(GPT_OSS_20B, num_hidden_layers=args.layers)})
    shapes = d.tensors(cfg)
    rows = ["| experts | GB on the card | w1 bound | prefill tok/s (" + " / ".join(map(str, args.prompts)) + ") "
            "| " + " | ".join(f"w{w} round (graph)" for w in WIDTHS) + " | w1 / bound | w8 ahead, tok/s |",
            "|" + "---|" * (6 + len(WIDTHS))]  # fmt: skip
    for mx in (True, False) if args.bf16 else (True,):
        weights = device_weights(shapes, torch, experts_bf16=not mx)
        if mx:
            weights.update(mxfp4_experts(shapes))
        be = CudaBackend()
        plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=8 << 30, host_kv_budget_bytes=0,
                       max_context=4096)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
        res = bench_ignis(be, cfg, np.random.default_rng(0), args.prompts, args.rounds)
        be.unload()
        bound = bound_bytes(shapes, cfg, sum(expert_bytes(cfg, mx))) / bw
        prefill = " / ".join(f"{n / res[('prefill', n)]:,.0f}" for n in args.prompts)
        rounds = " | ".join(f"{res[('decode', w)] * 1e3:.2f} ({res[('graph', w)] * 1e3:.2f}) ms" for w in WIDTHS)
        rows.append(f"| {'MXFP4 as stored' if mx else 'bf16'} | {plan.weights_bytes / 1e9:.1f} | {bound * 1e3:.2f} ms "
                    f"| {prefill} | {rounds} | {res[('decode', 1)] / bound:.2f}x | {8 / res[('ahead', 8)]:,.0f} |")  # fmt: skip
        print(rows[-1], flush=True)
    body = [
        f"gpt-oss-20b's shape ({args.layers} layers), random weights, built through the gpt_oss definition; read "
        f"bandwidth {bw / 1e12:.2f} TB/s; decode at 512-token contexts, median of {args.rounds} rounds (wall time "
        "of decode_round; in parentheses the decode graph alone); prefill: one prompt's wall time.",
        "",
        *rows,
    ]
    machine = f"{torch.cuda.get_device_name(0)}, {platform.node()}, torch {torch.__version__}"
    report(SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
