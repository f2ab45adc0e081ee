"""The CUDA backend's decode round for each dense architecture at an 8B-class shape.

Each model is built from its own definition (a config.json-like dict through
``config_from_hf``, so its blocks are what a real checkpoint of that shape gets)
with random bf16 weights made on the GPU, and timed like bench/bench_cuda.py:
the wall time of ``decode_round`` at widths 1 and 8 (512-token contexts) and
the decode graph alone, against the round's weight-streaming bound (every
tensor but the embedding, bf16, at the measured read bandwidth). With
``--write`` the table replaces the "Architectures on the CUDA backend (H200)"
section of docs/PERFORMANCE.md.

    python3 bench/bench_archs.py --write
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## Architectures on the CUDA backend (H200)"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)  # fmt: skip
SHAPES = {  # name -> (model_type, config.json fields): the public checkpoints' shapes
    "Llama-3.1-8B (llama)": ("llama", LLAMA_8B),
    "Mistral-7B-v0.1 (mistral, window 4096)": ("mistral", dict(LLAMA_8B, vocab_size=32000, sliding_window=4096)),
    "Qwen3-8B (qwen3)": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                       vocab_size=151936, rope_theta=1e6, max_position_embeddings=8192,
                                       tie_word_embeddings=False)),
    "Gemma-2-9B (gemma2)": ("gemma2", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                           num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                           vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096,
                                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                           max_position_embeddings=8192)),
    "Gemma-3-12B (gemma3_text)": ("gemma3_text", dict(hidden_size=3840, intermediate_size=15360,
                                                      num_hidden_layers=48, num_attention_heads=16,
                                                      num_key_value_heads=8, head_dim=256, vocab_size=262208,
                                                      query_pre_attn_scalar=256, sliding_window=1024,
                                                      rope_theta=1e6, rope_local_base_freq=10000.0,
                                                      rope_scaling={"rope_type": "linear", "factor": 8.0},
                                                      max_position_embeddings=8192)),
    "Phi-4 (phi3)": ("phi3", dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                                  num_attention_heads=40, num_key_value_heads=10, vocab_size=100352,
                                  rope_theta=250000.0, max_position_embeddings=8192)),
}  # fmt: skip


def llama_8b_on_cuda(torch, *, kv_budget_bytes: int, max_context: int, tuning=None):
    """The Llama-3.1-8B shape with random bf16 weights loaded on a CudaBackend: (backend, cfg, plan)."""
    from engine.backends.cuda import CudaBackend
    from engine.models import for_hf

    d = for_hf("llama")
    cfg = d.config_from_hf({"model_type": "llama", **LLAMA_8B})
    weights = make_weights(d, cfg, torch)
    be = CudaBackend(tuning) if tuning is not None else CudaBackend()
    plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=kv_budget_bytes, host_kv_budget_bytes=0,
                   max_context=max_context)  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    return be, cfg, plan


def make_weights(d, cfg, torch) -> dict:
    """Random bf16 tensors on the GPU for every canonical tensor; norms near their scale."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shape in d.tensors(cfg).items():
        if len(shape) >= 2:
            t = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * (shape[-1] ** -0.5)
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.1
        else:
            t = 1 + 0.1 * torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        out[name] = t
    return out


def streamed_bytes(d, cfg) -> int:
    """bf16 bytes a round reads: every tensor but the embedding (a tied head reads it once)."""
    n = 0
    for name, shape in d.tensors(cfg).items():
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue
        n += int(np.prod(shape))
    return 2 * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--only", nargs="*", default=None, help="names (substrings) of SHAPES to run")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--kernel-cache-dir", default="")
    args = ap.parse_args()

    import pycuda.driver as cuda
    import torch

    from bench.bench_cuda import bench_ignis, read_bandwidth
    from bench.perfdoc import command_line, report
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.cu import runtime
    from engine.models import for_hf

    torch.cuda.init()
    with runtime.current():
        bw = read_bandwidth(cuda, cuda.Stream())
    rows = ["| model | layers | GB a round | bound | w1 round (graph) | w1 / bound | w8 round (graph) | w8 / bound "
            "| w8 / w1 | load s |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, (model_type, fields) in SHAPES.items():
        if args.only and not any(o in label for o in args.only):
            continue
        try:
            d = for_hf(model_type)
        except ValueError as e:  # not in this checkout
            print(f"{label}: skipped ({e})", flush=True)
            continue
        cfg = d.config_from_hf({"model_type": model_type, **fields})
        weights = make_weights(d, cfg, torch)
        be = CudaBackend(CudaTuning(kernel_cache_dir=args.kernel_cache_dir))
        t0 = time.perf_counter()
        be.load(cfg, weights, block_size=16, kv_budget_bytes=8 << 30, host_kv_budget_bytes=0, max_context=2048)
        load_s = time.perf_counter() - t0
        del weights
        torch.cuda.empty_cache()
        ig = bench_ignis(be, cfg, np.random.default_rng(0), [64], args.rounds)
        be.unload()
        gb = streamed_bytes(d, cfg)
        bound = gb / bw
        w1, w8, g1, g8 = ig[("decode", 1)], ig[("decode", 8)], ig[("graph", 1)], ig[("graph", 8)]
        rows.append(
            f"| {label} | {cfg.num_layers} | {gb / 1e9:.2f} | {bound * 1e3:.2f} ms | {w1 * 1e3:.2f} ({g1 * 1e3:.2f}) ms "
            f"| {w1 / bound:.2f}x | {w8 * 1e3:.2f} ({g8 * 1e3:.2f}) ms | {w8 / bound:.2f}x | {w8 / w1:.2f} "
            f"| {load_s:.1f} |"
        )
        print(rows[-1], flush=True)
    machine = f"{torch.cuda.get_device_name(0)}, {platform.node()}, torch {torch.__version__}"
    body = [
        f"Random bf16 weights at each public checkpoint's shape, built through its model definition; read "
        f"bandwidth {bw / 1e12:.2f} TB/s; decode at 512-token contexts, median of {args.rounds} rounds "
        "(wall time of decode_round; in parentheses the decode graph alone).",
        "",
        *rows,
    ]
    report(SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
