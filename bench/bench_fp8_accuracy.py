"""FP8 e4m3 weights, per output channel against 128 x 128 blocks: how far each moves a model from bf16.

Two measurements (CPU, numpy):

* the default model (SmolLM2-135M, its GGUF dequantized to float32 and rounded to bf16 as the
  reference): every projection quantized by ``engine.loaders.fp8.quantize_fp8``, the numpy
  backend's last-position logits on a few prompts, cosine against the bf16 run, and how often
  the greedy next token agrees;
* Llama-3.1-8B's layer shapes (q, k|v, o, gate|up, down) with random heavy-tailed weights (Student-t
  entries, log-normal row and column scales) and activations with a few outlier features: the
  product ``x @ W.T`` for 8 rows, cosine against bf16 weights.

    .venv/bin/python bench/bench_fp8_accuracy.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris, Berlin, Madrid, Rome and",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans landed on",
    "import numpy as np\nx = np.",
]
SHAPES_8B = {"q_proj": (4096, 4096), "k|v_proj": (1024, 4096), "o_proj": (4096, 4096),
             "gate|up_proj": (14336, 4096), "down_proj": (4096, 14336)}  # fmt: skip
SCHEMES = {"per channel": None, "128x128 blocks": 128}


def bf16(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def last_logits(cfg, weights, prompts) -> np.ndarray:
    from engine.backend import PrefillSpan, StepOutput
    from engine.backends.numpy import NumpyBackend

    be = NumpyBackend()
    be.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=256)
    rows = []
    for i, ids in enumerate(prompts):
        out = StepOutput()
        be.prefill(PrefillSpan(i, ids, 0, list(range(16)), want_logits=True), out)
        rows.append(out.prefill_logits)
    be.unload()
    return np.stack(rows)


def small_model() -> list[str]:
    from engine.loaders import load_artifact
    from engine.loaders.fp8 import is_quantizable, quantize_fp8
    from engine.tokenizer import load_tokenizer

    path = next((ROOT / "models" / "smollm2-135m-instruct").glob("*.gguf"))
    cfg, weights = load_artifact(path)
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref_w = {n: bf16(w) for n, w in weights.items()}
    ref = last_logits(cfg, ref_w, prompts)
    lines = [f"| {path.name} (bf16 reference) | held (embedding float32) | logits cosine, min over {len(prompts)} prompts | "
             "greedy token agrees |", "| --- | --- | --- | --- |"]  # fmt: skip
    for label, block in SCHEMES.items():
        q = {n: quantize_fp8(w, block) if is_quantizable(n, w) else w for n, w in ref_w.items()}
        nbytes = sum(t.nbytes for t in q.values())
        deq = {n: t.dequantize() if hasattr(t, "dequantize") else t for n, t in q.items()}
        got = last_logits(cfg, deq, prompts)
        cos = min(cosine(a, b) for a, b in zip(got, ref))
        agree = int(np.sum(got.argmax(1) == ref.argmax(1)))
        lines.append(f"| fp8 {label} | {nbytes / 1e6:.1f} MB | {cos:.5f} | {agree}/{len(prompts)} |")
    return lines


def shapes_8b() -> list[str]:
    from engine.loaders.fp8 import quantize_fp8

    rng = np.random.default_rng(0)
    lines = ["| Llama-3.1-8B matrix [out, in] | " + " | ".join(f"fp8 {s}: cosine of x @ W.T" for s in SCHEMES) + " |",
             "| --- | " + " | ".join("---" for _ in SCHEMES) + " |"]  # fmt: skip
    for name, (n, k) in SHAPES_8B.items():
        w = rng.standard_t(5, (n, k)).astype(np.float32)
        w *= rng.lognormal(0, 0.5, (n, 1)).astype(np.float32) * rng.lognormal(0, 0.5, (1, k)).astype(np.float32)
        w *= np.float32(0.02)
        x = rng.standard_normal((8, k)).astype(np.float32)
        x[:, rng.choice(k, 8, replace=False)] *= 30  # outlier features
        ref = x @ bf16(w).T
        cols = []
        for block in SCHEMES.values():
            cols.append(f"{cosine(x @ quantize_fp8(w, block).dequantize().T, ref):.6f}")
        lines.append(f"| {name} [{n}, {k}] | " + " | ".join(cols) + " |")
        del w
    return lines


def main() -> None:
    print(f"# {platform.node()} ({platform.machine()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("# .venv/bin/python bench/bench_fp8_accuracy.py")
    print("\n".join(small_model()))
    print()
    print("\n".join(shapes_8b()))


if __name__ == "__main__":
    main()
