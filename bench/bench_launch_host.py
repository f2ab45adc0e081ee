"""The host's share of a prefill pass: the Python time CudaBackend's step thread spends launching one
pass of the Llama-3.1-8B shape's kernels (engine/backends/cuda/forward.py ``prefill_rows``), with no
card: the kernels are built against tests/kernels' stand-ins for nvcc and the driver, whose launch
only notes the call, so what is timed is the engine's own launch path (``Kernels``, ``launch.Kernel``,
``hopper``) plus that note (~0.5-1 us a launch here), not PyCUDA's packing or the driver's launch.

On a card a prefill pass's kernels run while the step thread queues the next ones; its host time
matters where it nears the device's (short passes) or where the thread waits on the interpreter lock
(a burst of requests arriving: docs/PERFORMANCE.md). Run from the repo root:

    .venv/bin/python bench/bench_launch_host.py
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.perfdoc import command_line, report  # noqa: E402
from tests.kernels import fake_nvcc  # noqa: E402

SECTION = "## The host's part of a prefill pass (no card, issue 15)"

SHAPE = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
             intermediate_size=14336, vocab_size=49152, num_layers=32)  # fmt: skip


def forward(calls):
    """A ``Forward`` of the 8B shape over made-up device addresses, and the prefill staging's."""
    from engine.backends.cuda.forward import Forward, KVLayout, Workspace
    from engine.backends.cuda.weights import Layer
    from engine.cu import hopper
    from engine.cu.kernels import Kernels

    # the tensor maps (the driver's cuTensorMapEncodeTiled) and the cubin's parameter table are the card's
    hopper.tensor_map = hopper.encode_map = lambda *a, **k: bytes(128)
    hopper.param_layout = lambda cubin, name: [(8 * i, 8) for i in range(16)]
    hopper.pack_format = lambda layout, codes: "".join(codes)
    kern = Kernels(128, 4, cache_dir=tempfile.mkdtemp())
    kern.gemv_cap = 16  # cuda.round_rows: a pass of more rows runs the GEMM
    top = [1 << 36]

    def alloc(n: int) -> int:
        p = top[0]
        top[0] += -(-n // 4096) * 4096 + 4096
        return p

    c = SimpleNamespace(**SHAPE)
    hid, inter = c.hidden_size, c.intermediate_size
    n_qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    mlp = SimpleNamespace(mlp=SimpleNamespace(act="silu"))
    layers = [
        Layer(
            block=mlp,
            ln1=alloc(2 * hid),
            ln2=alloc(2 * hid),
            qkv=alloc(2 * n_qkv * hid),
            qkv_bias=0,
            o=alloc(2 * hid * hid),
            o_bias=0,
            gate_up=alloc(4 * inter * hid),
            down=alloc(2 * hid * inter),
            inv_freq=alloc(256),
            rope_factor=1.0,
            rotary_dim=c.head_dim,
            q_norm=0,
            k_norm=0,
            attn_post_norm=0,
            mlp_post_norm=0,
            attn=kern.plain,
        )  # fmt: skip
        for _ in range(c.num_layers)
    ]
    w = SimpleNamespace(embed=alloc(2 * c.vocab_size * hid), embed_scale=1.0, layers=layers, gate_up_interleaved=True,
                        lm_head=alloc(2 * c.vocab_size * hid), final_norm=alloc(2 * hid), head_softcap=None)  # fmt: skip
    kv = KVLayout(base=alloc(1 << 30), block_size=16, layer_stride=2 * 16 * 8 * 128, block_stride=32 * 4 * 16 * 8 * 128)
    fw = Forward(c, kern, SimpleNamespace(handle=1), w, Workspace.allocate(c, SimpleNamespace(alloc=alloc)), kv)
    return fw, [alloc(1 << 16) for _ in range(4)]


def measure(passes: int) -> list[str]:
    """``| pass | launches | host ms | us a launch |`` rows of each case, from ``passes`` timed passes."""
    cases = [("1 span of 25 rows", 1, 25), ("6 spans of 24 rows", 6, 24), ("1 span of 128 rows", 1, 128)]
    # (6 spans: one attention launch a layer for all of them, cuda.attention_spans' path; one a span before it)
    with fake_nvcc.installed(fake_nvcc.Nvcc()) as calls:
        fw, (tokens, positions, slots, tables) = forward(calls)
        # the pass's span table (its contents are the card's business); a tree before 2026-12-08 takes none
        takes_table = "span_table" in inspect.signature(fw.prefill_rows).parameters
        extra = {"span_table": tables + (1 << 15)} if takes_table else {}
        out = []
        for label, n_spans, n in cases:
            spans = [(n * i, n, tables + 256 * i, 16) for i in range(n_spans)]
            rows = n * n_spans
            calls.calls.clear()
            fw.prefill_rows(rows, tokens, positions, slots, spans, **extra)
            launches = sum(1 for c in calls.calls if c[1] == "launch")
            times = []
            for _ in range(passes):
                calls.calls.clear()
                t = time.perf_counter()
                fw.prefill_rows(rows, tokens, positions, slots, spans, **extra)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            out.append(f"| {label} | {launches} | {ms:.2f} | {ms / launches * 1e3:.1f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=200, help="timed passes a case (median of them)")
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    ap.add_argument("--before", metavar="TREE", help="also time another checkout of the repo (git archive of a "
                    "commit), this script copied into it; its rows labelled with --before-label")  # fmt: skip
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = measure(args.passes)
    if args.rows_only:
        print("\n".join(rows))
        return
    label = "this tree"
    if args.before:
        target = Path(args.before) / "bench" / "_bench_launch_host.py"
        shutil.copy(__file__, target)
        try:
            run = subprocess.run([sys.executable, str(target), "--rows-only", "--passes", str(args.passes)],
                                 cwd=args.before, capture_output=True, text=True, check=True)  # fmt: skip
        finally:
            target.unlink()
        rows = [f"| {args.before_label} | {r[2:]}" for r in run.stdout.splitlines() if r.startswith("|")] + [
            f"| {label} | {r[2:]}" for r in rows
        ]
    else:
        rows = [f"| {label} | {r[2:]}" for r in rows]
    body = ["Model: the Llama-3.1-8B shape's launches (32 layers, bf16 weights, gemm_hopper and prefill_attn_hopper "
            "routed as on sm_90; `cuda.round_rows`' GEMV cap 16, so every pass below runs the GEMM); the stand-in "
            "driver notes each launch instead of making it. Medians of the passes.", "",
            "| tree | pass | launches | host ms a pass (median) | us a launch |", "|---|---|---|---|---|", *rows]  # fmt: skip
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, no card"
    report(SECTION, machine=machine, command=command_line(".venv/bin/python"), body=body, write=args.write)


if __name__ == "__main__":
    main()
