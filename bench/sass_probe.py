"""The SASS of one kernel as the backend builds it, counted on a machine without a GPU (issue 14).

Compiles ``engine/cu/<module>.cu`` with the defines the backend would pass (``engine.cu.launch._build``,
so the source and options are the backend's) to a cubin for sm_90 with ``nvcc -cubin``, prints ptxas'
registers and spills for every function, then disassembles ``--function`` with ``cuobjdump -sass`` and
prints its instruction count, an opcode histogram, and the instructions between the first mbarrier wait
and the next block barrier (gemv_q.cu's stage loop). cuobjdump: on PATH, or from the package index's
``nvidia-cuda-cuobjdump`` wheel unpacked anywhere (``--cuobjdump PATH``).

    python3 bench/sass_probe.py gemv_q --format Q4_K --function gemv_q_swiglu
    python3 bench/sass_probe.py gemv_q --format Q4_K --tuning 4,4,2 --function gemv_q_store --dump q4k.sass
    python3 bench/sass_probe.py attention_decode --define HEAD_DIM=128 GROUP=4 --function decode_attn
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def defines_for(args) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """(defines, sources compiled before) of the module as the backend builds it."""
    extra = tuple((k, int(v)) for k, v in (d.split("=") for d in args.define))
    if args.module == "gemv_q":
        from engine.cu.quant import gemv_q_defines

        tune = tuple(int(v) for v in args.tuning.split(",")) if args.tuning else None
        return gemv_q_defines(args.format, tune)[0] + extra, ("gemv",)
    if args.module == "attention_decode":
        from engine.cu.kernels import DECODE_SPLITS, DECODE_THREADS

        base = (("NUM_SPLITS", DECODE_SPLITS), ("DECODE_THREADS", DECODE_THREADS))
        return base + extra, ()
    return extra, ()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", help="engine/cu/<module>.cu")
    ap.add_argument("--format", default="Q4_K", help="gemv_q: the GGUF type (or FP8)")
    ap.add_argument("--tuning", default="", help="gemv_q: QU,QMINB,QNST[,QKH[,QUF]] (default: committed)")
    ap.add_argument("--define", nargs="*", default=[], help="more NAME=VALUE defines")
    ap.add_argument("--function", default="", help="the kernel to disassemble")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--dump", default="", help="write the function's SASS here")
    args = ap.parse_args()
    from engine.cu.launch import _build

    defines, after = defines_for(args)
    src, options, _ = _build(args.module, defines, tempfile.gettempdir(), after)
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(src)
        r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", *options, "-Xptxas", "-v", "-o", str(cubin), str(cu)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            sys.exit(r.stderr[-4000:])
        print(f"{args.module} {' '.join(f'{k}={v}' for k, v in defines)}")
        fn = None
        for line in r.stderr.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                fn = m.group(1)
            elif m := re.search(r"(\d+) bytes spill stores", line):
                spills = m.group(1)
            elif (m := re.search(r"Used (\d+) registers", line)) and fn:
                print(f"  {fn}: {m.group(1)} registers, {spills} bytes spilled")
        if not args.function:
            return
        out = subprocess.run([args.cuobjdump, "-sass", "-fun", args.function, str(cubin)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", out)]
    if args.dump:
        Path(args.dump).write_text(out)
    print(f"{args.function}: {len(ops)} instructions")
    hist = collections.Counter(op.split(".")[0] for op in ops)
    print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common(16)))
    waits = [i for i, op in enumerate(ops) if op.startswith("SYNCS.PHASECHK")]
    bars = [i for i, op in enumerate(ops) if op.startswith("BAR.SYNC")]
    if waits and (after_wait := [b for b in bars if b > waits[0]]):
        loop = ops[waits[0] : after_wait[0]]
        print(f"  from the first mbarrier wait to the next block barrier: {len(loop)} instructions, "
              f"{sum(op.startswith('HMMA') or op.startswith('IMMA') for op in loop)} mma")  # fmt: skip


if __name__ == "__main__":
    main()
