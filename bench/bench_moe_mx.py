"""gpt-oss-20b's MoE layers with bf16 experts against MXFP4 experts as stored (docs/MOE.md).

24 layers of hidden 2880, 32 experts of width 2880 (top 4), swiglu_oai with router and expert
biases; random device weights (the MXFP4 blobs' codes random, their scales 2^-7). Only the MoE
part of a decode round: ``DeviceMoE.decode`` for every layer in one CUDA graph per width, against
the bound of the bytes it must read at 4.4 TB/s (routers and the distinct experts the round's rows
chose); then one prefill chunk of 512 rows through all layers, event-timed: MXFP4 through the GEMMs
reading its tiles and, for comparison, through each layer's experts dequantized into a bf16 scratch.

    python3 bench/bench_moe_mx.py [--widths 1 8 32] [--write]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import perfdoc  # noqa: E402
from bench.bench_moe import FILL, time_graph  # noqa: E402
from engine.backends.cuda.moe import MAX_DECODE_ROWS  # noqa: E402

SECTION = "## MXFP4 experts as stored (gpt-oss-20b shape)"
L, H, E, K, INTER = 24, 2880, 32, 4, 2880
BW = 4.4e12
PREFILL_ROWS = 512


class Stack:
    """Random device weights of the MoE layers, bf16 or MXFP4 experts, and a ``DeviceMoE``."""

    def __init__(self, cuda, stream, mem, mx: bool, defines: tuple = ()) -> None:
        from pycuda.compiler import SourceModule

        from engine.backends.cuda.moe import DeviceMoE, MoEKernels, MoELayer, MoEWorkspace
        from engine.cu import mxfp4
        from engine.model_config import ModelConfig
        from engine.models.ops import MoE

        fill = SourceModule(FILL, no_extern_c=True, arch="sm_90").get_function("fill_bf16")
        seed = [1]

        def rand(n: int, scale: float = 0.03) -> int:  # n bf16 values (2n bytes)
            p = mem.alloc(n * 2)
            fill(np.uintp(p), np.uint64(n), np.uint32(seed[0]), np.float32(scale), block=(256, 1, 1), grid=(4096, 1))
            seed[0] += 1
            return p

        def blobs(n: int, k: int) -> int:
            """E random MXFP4 blobs of n x k, every scale byte 120."""
            nbytes = mxfp4.blob_bytes(n, k)
            p = rand(E * nbytes // 2, 1.0)
            kp = mxfp4.padded_k(k)
            for e in range(E):
                cuda.memset_d8(p + e * nbytes + n * kp // 2, 120, n * kp // 32)
            return p

        def f32(n: int, scale: float) -> int:
            a = (np.random.default_rng(seed[0]).standard_normal(n) * scale).astype(np.float32)
            seed[0] += 1
            p = mem.alloc(a.nbytes)
            cuda.memcpy_htod(p, a)
            return p

        self.cuda, self.s, self.mx = cuda, stream, mx
        self.cfg = ModelConfig(arch="gpt_oss", vocab_size=201088, hidden_size=H, intermediate_size=INTER, num_layers=L,
                               num_heads=64, num_kv_heads=8, head_dim=64, num_experts=E, num_experts_per_tok=K,
                               moe_intermediate_size=INTER, rms_norm_eps=1e-5)  # fmt: skip
        self.op = MoE(E, K, norm_topk_prob=True, router_bias=True, expert_bias=True, act="swiglu_oai", swiglu_limit=7.0)
        ident = mem.alloc(E * 4)
        cuda.memcpy_htod(ident, np.arange(E, dtype=np.int32))
        self.layers = [MoELayer(
            router=rand(E * H, 0.05), router_bias=f32(E, 0.1),
            gu_pool=blobs(2 * INTER, H) if mx else rand(E * 2 * INTER * H),
            down_pool=blobs(H, INTER) if mx else rand(E * H * INTER),
            slot_of=ident, gu_bias=f32(E * 2 * INTER, 0.1), down_bias=f32(E * H, 0.1), mx=mx,
        ) for _ in range(L)]  # fmt: skip
        self.ws = MoEWorkspace(E, K, H, INTER, PREFILL_ROWS, mem, mx=mx, scratch=mx)  # both prefill paths
        self.moe = DeviceMoE(
            self.cfg, self.op, MoEKernels(mx=mx, mx_defines=defines, mx_tiles=True), self.layers, self.ws
        )
        self.x, self.xn = rand(PREFILL_ROWS * H * 2, 0.0), rand(PREFILL_ROWS * H, 1.0)  # x fp32 zeros
        self.expert_bytes = (mxfp4.blob_bytes(2 * INTER, H) + mxfp4.blob_bytes(H, INTER)) if mx else 3 * INTER * H * 2
        self.counts = mem.alloc(L * 4)

    def decode(self, rows: int, count: bool = False) -> None:
        for i in range(L):
            self.moe.decode(self.s, i, self.xn, self.x, rows)
            if count:
                self.cuda.memcpy_dtod_async(self.counts + 4 * i, self.ws.grp, 4, self.s)

    def bound_ms(self, rows: int) -> float:
        self.decode(rows, count=True)
        c = np.empty(L, np.int32)
        self.cuda.memcpy_dtoh(c, self.counts)
        return (int(c.sum()) * self.expert_bytes + L * E * H * 2) / BW * 1e3

    def prefill_ms(self, rows: int = PREFILL_ROWS, as_decode: int = 0, reps: int = 3) -> float:
        """One chunk of ``rows`` through the layers, event-timed; ``as_decode``: ``prefill_as_decode``."""
        import pycuda.driver as cuda

        self.moe.prefill_as_decode = as_decode
        for i in range(L):  # warm
            self.moe.prefill(self.s, i, self.xn, self.x, rows)
        a, b = cuda.Event(), cuda.Event()
        a.record(self.s)
        for _ in range(reps):
            for i in range(L):
                self.moe.prefill(self.s, i, self.xn, self.x, rows)
        b.record(self.s)
        b.synchronize()
        return b.time_since(a) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--breakdown", action="store_true", help="also time the router alone and with gate,up")
    ap.add_argument("--define", nargs="*", default=[], help="NAME=VALUE for the MXFP4 build (an experiment)")
    ap.add_argument(
        "--prefill-rows",
        type=int,
        nargs="*",
        default=[16, 64],
        help="short chunks also timed through both prefill paths (GEMM; the decode kernels)",
    )
    ap.add_argument("--write", action="store_true", help="update docs/PERFORMANCE.md")
    args = ap.parse_args()
    if any(not 1 <= r <= MAX_DECODE_ROWS for r in args.prefill_rows):
        ap.error(f"--prefill-rows: 1..{MAX_DECODE_ROWS}")
    from engine.cu import runtime
    from engine.cu.runtime import Allocations

    res = {}
    with runtime.current():
        import pycuda.driver as cuda

        name, s = cuda.Context.get_device().name(), cuda.Stream()
        for mx in (False, True):
            mem = Allocations()
            defines = tuple((k, int(v)) for k, v in (d.split("=") for d in args.define))
            st = Stack(cuda, s, mem, mx, defines)
            for w in args.widths:
                ms = time_graph(s, lambda st=st, w=w: st.decode(w)) * 1e3
                res[(mx, w)] = (ms, st.bound_ms(w))
            if args.breakdown:  # the later launches left out: router alone, then + gate,up
                kern, saved = st.moe.kern, (st.moe.kern.gate_up, st.moe.kern.down)
                for name, skip in (("router", ("gate_up", "down")), ("+ gate,up", ("down",))):
                    for n in skip:
                        setattr(kern, n, lambda *a, **kw: None)
                    for w in args.widths:
                        print(
                            f"{'mx' if mx else 'bf16'} {name} w{w}: {time_graph(s, lambda st=st, w=w: st.decode(w)) * 1e3:.3f} ms"
                        )
                    kern.gate_up, kern.down = saved
            res[(mx, "prefill")] = st.prefill_ms()
            if mx:  # the earlier path: each layer's experts dequantized into the bf16 scratch first
                from engine.backends.cuda.moe import MoEKernels

                tiles_kern, st.moe.kern = st.moe.kern, MoEKernels(mx=True, mx_defines=defines, mx_tiles=False)
                res["scratch"] = st.prefill_ms()
                st.moe.kern = tiles_kern
            for r in args.prefill_rows:
                res[(mx, "prefill", r)] = (st.prefill_ms(r), st.prefill_ms(r, as_decode=r))
            mem.free()
    body = [
        "",
        f"The MoE part of a decode round ({L} layers, one graph a width; bound: routers and the distinct "
        f"experts chosen at {BW / 1e12:.1f} TB/s) and a {PREFILL_ROWS}-row prefill chunk through the {L} layers.",
        "",
        "| rows | bf16 experts | its bound | MXFP4 as stored | its bound | MXFP4 / bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for w in args.widths:
        (b, bb), (m, mb) = res[(False, w)], res[(True, w)]
        body.append(f"| {w} | {b:.3f} ms | {bb:.3f} ms ({b / bb:.2f}x) | {m:.3f} ms | {mb:.3f} ms ({m / mb:.2f}x) | "
                    f"{m / b:.2f}x |")  # fmt: skip
    p0, p1 = res[(False, "prefill")], res[(True, "prefill")]
    body.append(f"| prefill {PREFILL_ROWS} | {p0:.2f} ms | | {p1:.2f} ms | | {p1 / p0:.2f}x |")
    p2 = res["scratch"]
    body.append(f"| prefill {PREFILL_ROWS}, MXFP4 through the bf16 scratch | | | {p2:.2f} ms | | {p2 / p0:.2f}x |")
    if args.prefill_rows:
        body += [
            "",
            "Short prefill chunks through the grouped GEMMs (MXFP4: after dequantizing the layer's experts) "
            "and through the decode kernels (`DeviceMoE.prefill_as_decode`):",
            "",
            "| rows | bf16, GEMM | bf16, decode kernels | MXFP4, dequant + GEMM | MXFP4, decode kernels |",
            "|---|---|---|---|---|",
        ]
        for r in args.prefill_rows:
            (bg, bd), (mg, md) = res[(False, "prefill", r)], res[(True, "prefill", r)]
            body.append(f"| {r} | {bg:.2f} ms | {bd:.2f} ms | {mg:.2f} ms | {md:.2f} ms |")
    perfdoc.report(SECTION, machine=f"{name}, {platform.node()}", command=perfdoc.command_line("python3"), body=body,
                   write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
