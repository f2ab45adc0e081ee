"""FP8 prefill on the tensor cores (``cuda.fp8_gemm``) against the dequant + bf16 GEMM it replaces.

1. The Llama-3.1-8B layer GEMMs alone at chunks of 128 .. 2,048 rows (CUDA events, median of 10 calls,
   random operands): the bf16 GEMM on bf16 weights (gemm_hopper), the FP8 matrix with fp8_gemm off
   (dequantized into the scratch, then gemm_hopper) and on (x quantized a row by quant_act_fp8, then
   gemm_hopper_fp8), with TFLOP/s of the product and the on / off ratio; and the on path's relative
   error against the off path's output (which keeps x in bf16) at 512 rows.
2. The whole 8B shape (``--layers``, random weights as tests/kernels/test_cuda_fp8.py's 8B test draws
   them, every layer projection fp8 per output channel): prefill of 512- and 4,096-token prompts in the
   CUDA default chunks with fp8_gemm off and on (``CudaBackend.retune``, the same loaded weights), the
   bf16 model's beside them, and the last position's logits cosine on / off and each against bf16.

Needs a Hopper device and torch (part 2); prints tables (docs/QUANT.md, "FP8 prefill on the tensor cores").

    python3 bench/bench_fp8_gemm.py [--layers 32] [--skip-model | --model-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"q,k,v": (6144, 4096), "o": (4096, 4096), "gate,up": (28672, 4096), "down": (4096, 14336)}
ROWS = (128, 512, 1024, 2048)


def timed(cuda, s, fn, reps: int = 10) -> float:
    fn()
    ts = []
    for _ in range(reps):
        a, b = cuda.Event(), cuda.Event()
        a.record(s)
        fn()
        b.record(s)
        b.synchronize()
        ts.append(b.time_since(a) / 1e3)
    return statistics.median(ts)


def gemms() -> list[str]:
    import pycuda.driver as cuda
    import torch

    from engine.cu import runtime
    from engine.cu.kernels import Kernels
    from engine.cu.quant import FP8, FP8_FORMATS, FP8B, Matrix, Part

    torch.cuda.init()
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| matrix [N, K] | rows | bf16 weights | fp8, dequant + bf16 GEMM | fp8 tensor cores | on / off | "
             "fp8 tiles (FP8B), dequant + bf16 GEMM | FP8B tensor cores |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    errs = []
    with runtime.current():
        s = cuda.Stream()
        off = Kernels(128, 4, formats=FP8_FORMATS)
        on = Kernels(128, 4, formats=FP8_FORMATS, fp8_gemm=True)
        nbytes = 2 * 28672 * 4096
        scratch = cuda.mem_alloc(nbytes)
        for k in (off, on):
            k.scratch, k.scratch_bytes = int(scratch), nbytes
        # The operands are drawn and quantized by torch on the same (primary) context: the FP8 layout is
        # e4m3 bytes then fp32 scales (a row's, or FP8B's row of tile scales); torch's cast rounds to
        # nearest even, as quantize_fp8 does, and every value is inside +-448 by construction.
        x = torch.randn(max(ROWS), 14336, device="cuda", generator=gen).to(torch.bfloat16)
        out = cuda.mem_alloc(4 * max(ROWS) * 28672)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
            wb = w.to(torch.bfloat16)
            scale = w.abs().amax(1) / 448
            codes = (w / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
            f8 = torch.cat([codes.reshape(-1), scale.contiguous().view(torch.uint8)])
            tiles = w.view(n // 128, 128, k // 128, 128)
            t_scale = tiles.abs().amax(dim=(1, 3)) / 448  # [n / 128, k / 128]
            codes = (tiles / t_scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn).view(torch.uint8)
            f8b = torch.cat(
                [codes.reshape(-1), t_scale.repeat_interleave(128, 0).contiguous().view(torch.uint8).reshape(-1)]
            )
            del w, tiles, codes
            torch.cuda.synchronize()
            mat = Matrix((Part(f8.data_ptr(), FP8, n),), k)
            matb = Matrix((Part(f8b.data_ptr(), FP8B, n),), k)
            for m in ROWS:
                xp = x.data_ptr()
                t_bf = timed(cuda, s, partial(off.linear, s, xp, wb.data_ptr(), 0, out, m, n, k))
                t_off = timed(cuda, s, partial(off.linear, s, xp, mat, 0, out, m, n, k))
                t_on = timed(cuda, s, partial(on.linear, s, xp, mat, 0, out, m, n, k))
                t_boff = timed(cuda, s, partial(off.linear, s, xp, matb, 0, out, m, n, k))
                t_bon = timed(cuda, s, partial(on.linear, s, xp, matb, 0, out, m, n, k))
                flop = 2 * m * n * k
                lines.append(f"| {name} [{n}, {k}] | {m} | {t_bf * 1e3:.3f} ms ({flop / t_bf / 1e12:.0f} TFLOP/s) | "
                             f"{t_off * 1e3:.3f} ms ({flop / t_off / 1e12:.0f}) | {t_on * 1e3:.3f} ms "
                             f"({flop / t_on / 1e12:.0f}) | {t_on / t_off:.2f}x | {t_boff * 1e3:.3f} ms | "
                             f"{t_bon * 1e3:.3f} ms ({flop / t_bon / 1e12:.0f}) |")  # fmt: skip
                if m == 512:
                    res = {}
                    for label, kern, mm in (("off", off, mat), ("on", on, mat), ("boff", off, matb), ("bon", on, matb)):
                        kern.linear(s, x.data_ptr(), mm, 0, out, m, n, k)
                        s.synchronize()
                        res[label] = cuda.from_device(out, (m, n), np.float32).astype(np.float64)
                    e = np.linalg.norm(res["on"] - res["off"]) / np.linalg.norm(res["off"])
                    eb = np.linalg.norm(res["bon"] - res["boff"]) / np.linalg.norm(res["boff"])
                    errs.append(f"{name}: {e:.4f} (FP8B {eb:.4f})")
            del wb, f8, f8b, mat, matb
            torch.cuda.empty_cache()
        scratch.free()
    lines.append("")
    lines.append("Relative error of the fp8 tensor-core output against the dequant + bf16 GEMM's (512 rows): "
                 + ", ".join(errs))  # fmt: skip
    return lines


def model(layers: int) -> list[str]:
    import torch

    from bench.bench_cuda import cuda_default_chunk, prefill_time
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.loaders.fp8 import is_quantizable
    from tests.kernels.test_cuda_fp8 import _torch_fp8, llama_8b_bf16
    from tests.kernels.test_cuda_model import cosine, prefill_logits

    torch.cuda.init()
    cfg, bf = llama_8b_bf16(torch, layers)
    kw = dict(block_size=16, kv_budget_bytes=4 << 30, host_kv_budget_bytes=0, max_context=8192)
    chunk = cuda_default_chunk()
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 512).tolist()
    times, logits = {}, {}

    def measure(be, label: str) -> None:
        for n in (512, 4096):
            rng = np.random.default_rng(n)
            prefill_time(be, cfg, rng, n, chunk)  # warm-up
            times[(label, n)] = prefill_time(be, cfg, rng, n, chunk, reps=3)
        logits[label] = prefill_logits(be, ids, list(range(-(-len(ids) // 16))))

    be = CudaBackend()
    be.load(cfg, bf, **kw)
    try:
        measure(be, "bf16")
    finally:
        be.unload()
    f8 = {n: _torch_fp8(torch, w) if is_quantizable(n, np.empty((1, 1))) else w for n, w in bf.items()}
    del bf
    torch.cuda.empty_cache()
    be = CudaBackend()
    be.load(cfg, f8, **kw)
    try:
        measure(be, "fp8, dequant + bf16 GEMM")
        be.retune(CudaTuning(fp8_gemm=True))  # (makes the context current itself)
        assert be.kern._fp8
        measure(be, "fp8, tensor cores")
    finally:
        be.unload()
    lines = [f"| weights ({layers} layers) | prefill 512 tokens | prefill 4,096 tokens (chunks of {chunk:,}) | "
             "logits cosine vs bf16 |", "|---|---|---|---|"]  # fmt: skip
    for label in ("bf16", "fp8, dequant + bf16 GEMM", "fp8, tensor cores"):
        cells = [f"{times[(label, n)] * 1e3:.1f} ms ({n / times[(label, n)]:,.0f} tok/s)" for n in (512, 4096)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {cosine(logits[label], logits['bf16']):.5f} |")
    on, off = logits["fp8, tensor cores"], logits["fp8, dequant + bf16 GEMM"]
    lines.append("")
    lines.append(f"fp8 tensor cores / dequant: prefill 512 {times[('fp8, tensor cores', 512)] / times[('fp8, dequant + bf16 GEMM', 512)]:.2f}x, "
                 f"4,096 {times[('fp8, tensor cores', 4096)] / times[('fp8, dequant + bf16 GEMM', 4096)]:.2f}x; "
                 f"logits cosine on vs off {cosine(on, off):.5f}; greedy token on / off / bf16: "
                 f"{int(np.argmax(on))} / {int(np.argmax(off))} / {int(np.argmax(logits['bf16']))}")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--skip-model", action="store_true", help="the GEMMs alone")
    ap.add_argument("--model-only", action="store_true", help="the whole model's prefill alone")
    args = ap.parse_args()
    import pycuda.driver as cuda

    from engine.cu import runtime

    with runtime.current():
        dev = cuda.Context.get_device()
        print(f"device: {dev.name()}")
    if not args.model_only:
        print("\n".join(gemms()), flush=True)
    if not args.skip_model:
        print()
        print("\n".join(model(args.layers)))


if __name__ == "__main__":
    main()
