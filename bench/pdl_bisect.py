"""Which source's PDL launches change a decode round (cuda.pdl, docs/CUDA.md): on the GPU machine,
test_cuda_pdl's scenario (the 8B-shaped llama with 2 layers or the small qwen2; greedy) with PDL off
twice (the baseline must repeat itself), on with every source, on with one source at a time and on
with all sources but one, in graphs and eagerly. One line a case: tokens equal, the first round
whose logits differ, the largest logit difference.

    python3 bench/pdl_bisect.py [--arch llama8b|qwen2] [--width 3] [--eager]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama8b", choices=["llama8b", "qwen2"])
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--modes", default="graph,eager")
    args = ap.parse_args()
    from engine.cu import kernels as K
    from engine.sampling import SamplingParams
    from tests.kernels import test_cuda_pdl as T
    from tests.kernels.hf_models import DEFAULT_ROPE, LLAMA3_ROPE, LLAMA8B, QWEN_SMALL

    if args.arch == "llama8b":
        be, cfg = T._load("llama", LLAMA3_ROPE, dict(LLAMA8B, num_hidden_layers=2))
    else:
        be, cfg = T._load("qwen2", DEFAULT_ROPE, QWEN_SMALL)
    params = SamplingParams(temperature=0.0)
    full = K.PDL_SOURCES

    def run(sources, on: bool, eager: bool):
        K.PDL_SOURCES = frozenset(sources)
        from dataclasses import replace

        be.retune(replace(be.tuning, pdl=on))
        be.graphs.eager = eager
        return T._rounds(be, cfg, args.width, params)

    def compare(name, base, got) -> None:
        (t0, l0), (t1, l1) = base, got
        first = next((r for r, (a, b) in enumerate(zip(l0, l1)) if not np.array_equal(a, b)), None)
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(l0, l1))
        print(f"{name:<44} tokens {'same' if t0 == t1 else 'DIFFER'}  first differing round {first}  "
              f"max |dlogit| {diff:.4g}", flush=True)  # fmt: skip

    for mode in args.modes.split(","):
        eager = mode == "eager"
        base = run(full, False, eager)
        compare(f"[{mode}] off again", base, run(full, False, eager))
        compare(f"[{mode}] on, all", base, run(full, True, eager))
        compare(f"[{mode}] on, all, again", base, run(full, True, eager))
        for s in sorted(full):
            compare(f"[{mode}] on, only {s}", base, run({s}, True, eager))
        for s in sorted(full):
            compare(f"[{mode}] on, all but {s}", base, run(full - {s}, True, eager))
    K.PDL_SOURCES = full
    be.unload()


if __name__ == "__main__":
    main()
