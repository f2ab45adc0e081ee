"""Cold load of a Llama-3.1-8B-shaped bf16 Hugging Face checkpoint on the CUDA backend:
the loader's read (and widening, on the float32 path) then the upload, and the peak host RSS,
with bf16 tensors kept as stored (engine/loaders/bf16.py, what the server does for the card) and
uploaded through pinned staging buffers (engine/backends/cuda/pinned.py, ``cuda.pinned_upload``
on), kept as stored but uploaded directly (permute, then ``memcpy_htod`` from pageable memory: the
default until a GPU session has checked the pinned path), and widened to float32 first (before that: the float32
tensors always go the direct path). Each variant runs in its own process
(peak RSS is per process); the checkpoint is written once with random weights (a shared random
pool, so 16 GB take seconds) and read from the page cache by both, so the figures are the
loader's and the upload's, not the disk's.

The kernel cache: the variants above load with one already filled (a warm cache, the server's
usual start). The second table loads the direct variant's tensors with an empty kernel cache
directory (``CudaTuning(kernel_cache_dir=<fresh dir>)``, every nvcc run of the load happening in
it) and with the cache the first of them filled, each with the compiles on the pool alongside the
upload (engine/cu/launch.py ``compiling``, the default) and in the serial order before it
(``CudaBackend.compile_workers = 0``: every module compiled, then the upload): the load's parts
are the upload, the wait for the compiles still running after it (``Compiling.bind``) and the
graph capture. With ``--write`` the tables replace their section of docs/PERFORMANCE.md.

    python3 bench/bench_load.py --write [--layers 32] [--dir /tmp/ignis-load-8b]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## Cold load (H200, issue 15)"
SHAPE = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)
SHARD = 4 << 30  # bytes of a safetensors shard


def _ratio(other: float, this: float, better: str, worse: str) -> str:
    """``this`` against ``other`` (times or sizes) in words: 2.00x faster at half, 3.50x slower at 3.5 times."""
    return f"{other / this:.2f}x {better}" if this <= other else f"{this / other:.2f}x {worse}"


def tensors(layers: int, vocab: int = SHAPE["vocab"]) -> list[tuple[str, tuple[int, ...]]]:
    h, i, kv = SHAPE["hidden"], SHAPE["inter"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]  # fmt: skip
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write_checkpoint(root: Path, layers: int, *, vocab: int = SHAPE["vocab"], bos: int = 1, eos: int = 2) -> int:
    """config.json and bf16 safetensors shards of random weights (N(0, 0.02), norms near 1); ``vocab``
    and the bos / eos ids for a tokenizer of another vocabulary (bench/bench_serving_gpu.py)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": SHAPE["hidden"],
        "intermediate_size": SHAPE["inter"], "num_hidden_layers": layers, "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"], "head_dim": SHAPE["head_dim"], "vocab_size": vocab,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    pool = (np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32) * 0.02).view(np.uint32)
    pool = ((pool + 0x7FFF + ((pool >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    ones = np.full(SHAPE["inter"], 0x3F80, np.uint16).tobytes()  # bf16 1.0
    shards, cur, size = [], [], 0
    for name, shape in tensors(layers, vocab):
        n = int(np.prod(shape)) * 2
        if cur and size + n > SHARD:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, n))
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape, n in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(root / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for _name, shape, n in shard:
                src = ones if len(shape) == 1 else pool
                for start in range(0, n, len(src)):
                    f.write(src[: min(len(src), n - start)])
        total += off
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


VARIANTS = {  # name: (bf16 kept as stored, the uploader's pinned staging), label
    "pinned": ((True, True), "bf16 as stored, pinned staging (cuda.pinned_upload on, the default)"),
    "direct": ((True, False), "bf16 as stored, direct upload (cuda.pinned_upload off)"),
    "float32": ((False, False), "widened to float32, direct upload"),
}


# The kernel cache variants: the direct variant's tensors; (empty cache, compiles on the pool), label
KERNEL_VARIANTS = {
    "cold": ((True, True), "empty kernel cache, compiles alongside the upload (the default)"),
    "cold_serial": ((True, False), "empty kernel cache, serial order (every compile, then the upload)"),
    "warm": ((False, True), "warm kernel cache, alongside the upload"),
    "warm_serial": ((False, False), "warm kernel cache, serial order"),
}


def _timed(owner, attr: str, parts: dict, key: str) -> None:
    """Wrap ``owner.attr`` (a function or method) so its calls' seconds add up in ``parts[key]``."""
    fn = getattr(owner, attr)

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, attr, timed)


def run_variant(root: Path, keep: bool, pinned: bool, kernel_cache: str = "", workers: int | None = None) -> dict:
    """In this process: the loader, then the CUDA load (``pinned``: the upload through the staging
    buffers, else the direct path; ``kernel_cache``: the kernel cache directory, "" the default;
    ``workers``: ``CudaBackend.compile_workers``); seconds (the load's upload, bind wait and graph
    capture apart) and peak RSS."""
    from engine.backends import create_backend
    from engine.backends.cuda import graphs
    from engine.backends.cuda import weights as device_weights
    from engine.config import CudaTuning, EngineConfig
    from engine.cu import launch
    from engine.loaders import load_artifact

    parts: dict[str, float] = {}
    _timed(device_weights, "upload", parts, "weights")
    _timed(launch.Compiling, "bind", parts, "bind")
    _timed(graphs.GraphRunner, "capture", parts, "capture")
    t0 = time.perf_counter()
    cfg, weights = load_artifact(root, bf16_as_stored=keep)
    t1 = time.perf_counter()
    tuning = CudaTuning(pinned_upload=pinned, kernel_cache_dir=kernel_cache)
    be = create_backend("cuda", EngineConfig(backend="cuda", cuda=tuning))
    be.compile_workers = workers
    be.load(cfg, weights, block_size=16, kv_budget_bytes=1 << 30, host_kv_budget_bytes=0, max_context=4096)
    t2 = time.perf_counter()
    del weights
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights_bytes = be.plan.weights_bytes
    be.unload()
    return {"read": t1 - t0, "upload": t2 - t1, "rss": rss, "weights_bytes": weights_bytes, **parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/ignis-load-8b")
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    ap.add_argument("--variant", choices=(*VARIANTS, "kernels"), help=argparse.SUPPRESS)
    ap.add_argument("--kernel-cache", default="", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir)
    if args.variant == "kernels":  # the direct variant's tensors with this kernel cache and pool
        print(json.dumps(run_variant(root, True, False, args.kernel_cache, args.workers)))
        return
    if args.variant:
        print(json.dumps(run_variant(root, *VARIANTS[args.variant][0], kernel_cache=args.kernel_cache)))
        return
    t = time.perf_counter()
    nbytes = write_checkpoint(root, args.layers)
    print(f"wrote {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s", flush=True)

    def variant_run(variant: str, cache: str, *extra: str) -> dict:
        cmd = [sys.executable, __file__, "--variant", variant, "--dir", str(root), "--layers", str(args.layers),
               "--kernel-cache", cache, *extra]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(variant, *extra, row, flush=True)
        return row

    kernels = {}
    with tempfile.TemporaryDirectory(prefix="ignis-kernels-") as tmp:
        warm = str(Path(tmp) / "warm")  # the first cold run fills it
        for variant, ((cold, pool), _) in KERNEL_VARIANTS.items():  # "cold" first: it fills ``warm``
            cache = str(Path(tempfile.mkdtemp(dir=tmp))) if cold and variant != "cold" else warm
            kernels[variant] = variant_run("kernels", cache, *(() if pool else ("--workers", "0")))
        rows = {variant: variant_run(variant, warm) for variant in VARIANTS}
    from bench.perfdoc import command_line, report

    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() or "no GPU"  # fmt: skip
    body = [
        "",
        f"Llama-3.1-8B shape with {args.layers} layers, random bf16 weights, {nbytes / 1e9:.2f} GB of safetensors "
        "in 4 GB shards read from the page cache (the disk is not in these figures); the KV pool 1 GiB. bf16 "
        "kept as stored is a view of the mapped file, so its bytes are first read in the upload column.",
        "",
        "| tensors | read (loader) | upload | load in all | peak host RSS |",
        "|---|---|---|---|---|",
    ]
    for variant, (_, label) in VARIANTS.items():
        r = rows[variant]
        body.append(f"| {label} | {r['read']:.1f} s | {r['upload']:.1f} s | {r['read'] + r['upload']:.1f} s "
                    f"| {r['rss'] / 1e9:.1f} GB |")  # fmt: skip
    body += [
        "",
        "The direct variant's tensors by kernel cache: compile (about 26 s of nvcc for the modules a load needs, "
        "bench/precompile.py) on a pool of the machine's CPUs (at most 16) alongside the upload, or in the serial "
        "order; bind wait: the compiles still running after the upload, each module then loaded and its kernels "
        "prepared; capture: the decode graphs; the backend's load: compile, upload and capture (in the serial "
        "order the compiles come first, in none of the parts before it).",
        "",
        "| kernel cache | read (loader) | upload | bind wait | capture | the backend's load | load in all |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, (_, label) in KERNEL_VARIANTS.items():
        r = kernels[variant]
        body.append(f"| {label} | {r['read']:.1f} s | {r.get('weights', 0.0):.1f} s | {r.get('bind', 0.0):.1f} s "
                    f"| {r.get('capture', 0.0):.1f} s | {r['upload']:.1f} s | {r['read'] + r['upload']:.1f} s |")  # fmt: skip
    b, d, f = rows["pinned"], rows["direct"], rows["float32"]
    total = {k: r["read"] + r["upload"] for k, r in rows.items()}
    body += ["", f"Pinned staging: {_ratio(total['direct'], total['pinned'], 'faster', 'slower')} than the direct "
             f"upload of the same tensors, {_ratio(d['rss'], b['rss'], 'less', 'more')} peak RSS; "
             f"{_ratio(total['float32'], total['pinned'], 'faster', 'slower')} than widening to float32, "
             f"{_ratio(f['rss'], b['rss'], 'less', 'more')} peak RSS."]  # fmt: skip
    k = {v: r["read"] + r["upload"] for v, r in kernels.items()}
    body += ["", f"An empty kernel cache: {k['cold']:.1f} s in all with the compiles alongside the upload, "
             f"{k['cold_serial']:.1f} s in the serial order; a warm one {k['warm']:.1f} s and "
             f"{k['warm_serial']:.1f} s."]  # fmt: skip
    report(SECTION, machine=f"{gpu}, {platform.node()}", command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
