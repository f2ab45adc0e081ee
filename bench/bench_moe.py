"""Benchmark of the MoE kernels on a Qwen3-30B-A3B-shaped layer stack with random bf16 weights.

48 layers of hidden 2048, 32 q / 4 KV heads of 128, 128 experts (top 8, expert width 768), a
151,936-token tied head. A decode round is built here from the dense kernels
(``engine.cu.kernels.Kernels``: q|k|v + rope + KV write, decode attention over 512 positions, o
with the fused residual add and RMSNorm) and ``DeviceMoE.decode`` per layer, then the LM head, and
captured in one CUDA graph per width (Qwen3's QK-norm and sampling are left out: the forward that
runs them is not this module's). Reported: round time at widths 1 and 8 against the bound of the
bytes the round must read at 4.4 TB/s (attention and router weights, the distinct experts the
round's rows chose, the head); the MoE part alone (48 layers of ``decode``) against its bytes.
Then the expert cache with half the experts in pinned host RAM, on a scripted routing (Zipf over
each layer's experts, a token keeping each of its previous choices with probability ``--reuse``):
tok/s and hit rate, uncaptured (a cached round reads routing back once a layer).

    python3 bench/bench_moe.py --write
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

from bench import perfdoc  # noqa: E402

SECTION = "## MoE decode (H200, Qwen3-30B-A3B shape)"
L, H, E, K, INTER, HEADS, KVH, D, VOCAB = 48, 2048, 128, 8, 768, 32, 4, 128, 151936
CONTEXT, BLOCK = 512, 16
BW = 4.4e12

FILL = r"""
extern "C" __global__ void fill_bf16(unsigned short* p, unsigned long long n, unsigned int seed, float scale) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 2654435761u ^ seed ^ (unsigned int)(i >> 32) * 40503u;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        float v = ((h & 0xffffff) / 16777216.f * 2.f - 1.f) * scale;
        p[i] = (unsigned short)(__float_as_uint(v) >> 16);
    }
}
"""


class Model:
    """Random device weights of the stack, a resident ``DeviceMoE`` and a round body."""

    def __init__(self, cuda, stream, mem) -> None:
        from pycuda.compiler import SourceModule

        from engine.backends.cuda.moe import DeviceMoE, MoEKernels, MoELayer, MoEWorkspace
        from engine.cu.kernels import DECODE_SPLITS, Kernels
        from engine.model_config import ModelConfig
        from engine.models.ops import MoE

        fill = SourceModule(FILL, no_extern_c=True, arch="sm_90").get_function("fill_bf16")
        self.seed = 1

        def rand(n: int, scale: float = 0.03) -> int:
            p = mem.alloc(n * 2)
            fill(np.uintp(p), np.uint64(n), np.uint32(self.seed), np.float32(scale), block=(256, 1, 1), grid=(4096, 1))
            self.seed += 1
            return p

        self.cuda, self.s, self.mem = cuda, stream, mem
        self.cfg = ModelConfig(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=H, intermediate_size=6144, num_layers=L,
                               num_heads=HEADS, num_kv_heads=KVH, head_dim=D, num_experts=E, num_experts_per_tok=K,
                               moe_intermediate_size=INTER, rms_norm_eps=1e-6)  # fmt: skip
        self.op = MoE(E, K)
        self.k = Kernels(D, HEADS // KVH)
        ident = mem.alloc(E * 4)
        cuda.memcpy_htod(ident, np.arange(E, dtype=np.int32))
        ones = np.full(H, 0x3F80, np.uint16)  # bf16 1.0 norm weights
        self.norm = mem.alloc(H * 2)
        cuda.memcpy_htod(self.norm, ones)
        self.n_qkv = (HEADS + 2 * KVH) * D
        self.qkv = [rand(self.n_qkv * H) for _ in range(L)]
        self.o = [rand(H * HEADS * D) for _ in range(L)]
        self.moe_layers = [MoELayer(router=rand(E * H, 0.05), router_bias=0, gu_pool=rand(E * 2 * INTER * H),
                                    down_pool=rand(E * H * INTER), slot_of=ident, gu_bias=0, down_bias=0)
                           for _ in range(L)]  # fmt: skip
        self.embed = rand(VOCAB * H, 1.0)
        self.ws = MoEWorkspace(E, K, H, INTER, 8, mem)
        self.moe = DeviceMoE(self.cfg, self.op, MoEKernels(), self.moe_layers, self.ws)
        inv = (10000.0 ** (-np.arange(0, D, 2) / D)).astype(np.float32)
        self.inv_freq = mem.alloc(inv.nbytes)
        cuda.memcpy_htod(self.inv_freq, inv)
        # activations and a paged KV pool: 8 lanes x (CONTEXT / BLOCK + 1) blocks, every layer
        a = mem.alloc
        self.x, self.xn, self.q, self.attn = a(8 * H * 4), a(8 * H * 2), a(8 * HEADS * D * 2), a(8 * HEADS * D * 2)
        self.ss, self.logits = a(8 * 128 * 4), a(8 * VOCAB * 4)
        self.o_part, self.ml = a(8 * HEADS * DECODE_SPLITS * D * 4), a(8 * HEADS * DECODE_SPLITS * 2 * 4)
        self.bt_stride = CONTEXT // BLOCK + 1
        self.layer_stride = 2 * BLOCK * KVH * D
        self.block_stride = L * self.layer_stride
        nblocks = 8 * self.bt_stride
        self.cache = a(nblocks * self.block_stride * 2)
        cuda.memset_d8(self.cache, 0, nblocks * self.block_stride * 2)
        bt = np.arange(nblocks, dtype=np.int32).reshape(8, self.bt_stride)
        self.bt, self.pos = a(bt.nbytes), a(32)
        cuda.memcpy_htod(self.bt, bt)
        cuda.memcpy_htod(self.pos, np.full(8, CONTEXT, np.int32))
        self.slots = a(32)
        cuda.memcpy_htod(self.slots, (bt[:, CONTEXT // BLOCK] * BLOCK).astype(np.int32))
        self.tokens = a(32)
        cuda.memcpy_htod(self.tokens, np.arange(8, dtype=np.int32) * 1000)
        self.counts = a(L * 4)

    def attention(self, i: int, rows: int, nparts: int) -> int:
        k, s = self.k, self.s
        cache = self.cache + i * self.layer_stride * 2
        k.qkv_rope(s, self.xn, self.qkv[i], 0, self.q, rows, HEADS, KVH, H, self.pos, self.slots, self.inv_freq, cache,
                   BLOCK, self.block_stride, ss_in=(self.ss, nparts), eps=1e-6)  # fmt: skip
        k.decode_attention(s, self.q, self.pos, self.bt, self.bt_stride, cache, self.block_stride, BLOCK, KVH,
                           self.o_part, self.ml, self.attn, rows)  # fmt: skip
        return k.linear(s, self.attn, self.o[i], 0, self.x, rows, H, HEADS * D, accumulate=True,
                        norm_out=(self.norm, self.xn, self.ss))  # fmt: skip

    def round(self, rows: int, parts: str = "all", count: bool = False) -> None:
        """A decode round: embed, 48 x (attention, MoE), head. ``parts``: "all" | "moe" | "attn"."""
        k, s = self.k, self.s
        nparts = k.embed(s, self.tokens, self.embed, self.x, rows, H, norm_out=(self.norm, self.xn, self.ss))
        for i in range(L):
            if parts != "moe":
                nparts = self.attention(i, rows, nparts)
            if parts != "attn":
                nparts = self.moe.decode(s, i, self.xn, self.x, rows, ss_in=(self.ss, nparts), eps=1e-6,
                                         norm_out=(self.norm, self.xn, self.ss))  # fmt: skip
                if count:
                    self.cuda.memcpy_dtod_async(self.counts + 4 * i, self.ws.grp, 4, s)
        if parts == "all":
            k.linear(s, self.xn, self.embed, 0, self.logits, rows, VOCAB, H, ss_in=(self.ss, nparts), eps=1e-6)

    def distinct_experts(self, rows: int) -> np.ndarray:
        self.round(rows, count=True)
        c = np.empty(L, np.int32)
        self.cuda.memcpy_dtoh(c, self.counts)
        return c

    def bytes(self, rows: int, parts: str = "all") -> float:
        ex = int(self.distinct_experts(rows).sum()) * 3 * INTER * H * 2
        attn = L * (self.n_qkv * H + H * HEADS * D) * 2
        router = L * E * H * 2
        head = VOCAB * H * 2
        return {"all": attn + router + ex + head, "moe": router + ex, "attn": attn}[parts]


def time_graph(stream, body, reps: int = 30) -> float:
    import pycuda.driver as cuda

    from engine.cu.runtime import Graph

    body()
    g = Graph(stream, body)
    g.launch()
    stream.synchronize()
    a, b = cuda.Event(), cuda.Event()
    a.record(stream)
    for _ in range(reps):
        g.launch()
    b.record(stream)
    b.synchronize()
    g.destroy()
    return b.time_since(a) / reps / 1e3


def breakdown(m: Model, rows: int) -> list[tuple[str, float]]:
    """The MoE part (48 layers, one graph) with its later launches left out: cumulative times."""
    kern = m.moe.kern
    saved = kern.gate_up, kern.down
    out = []
    for name, skip in (("router + route", ("gate_up", "down")), ("+ gate,up", ("down",)), ("+ down + combine", ())):
        for n in skip:
            setattr(kern, n, lambda *a, **kw: None)
        out.append((name, time_graph(m.s, lambda: m.round(rows, "moe"))))
        kern.gate_up, kern.down = saved
    return out


def scripted_routing(tokens: int, lanes: int, reuse: float, seed: int = 0) -> np.ndarray:
    """ids [tokens, L, lanes, K]: per layer a Zipf(1) popularity over a random expert order; each token
    keeps each of its lane's previous choices with probability ``reuse``, the rest drawn fresh."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1)
    w /= w.sum()
    order = [rng.permutation(E) for _ in range(L)]
    out = np.zeros((tokens, L, lanes, K), np.int64)
    for i in range(L):
        for lane in range(lanes):
            cur: list[int] = []
            for t in range(tokens):
                keep = [e for e in cur if rng.random() < reuse]
                while len(keep) < K:
                    e = int(order[i][rng.choice(E, p=w)])
                    if e not in keep:
                        keep.append(e)
                out[t, i, lane] = cur = keep
    return out


def bench_cache(m: Model, args, lines: list[str]) -> None:
    """Half the experts in host RAM on the scripted routing: router weights zero, the router bias
    per (token, layer) scripts each lane's choice. Same routing fully resident for comparison."""
    import pycuda.driver as cuda

    from engine.backends.cuda.expert_cache import ExpertCache
    from engine.backends.cuda.moe import DeviceMoE

    s, T = m.s, args.tokens
    gu_elems, down_elems = 2 * INTER * H, H * INTER
    t0 = time.perf_counter()
    cache = ExpertCache(L, E, gu_elems, down_elems, L * E // 2, m.mem)
    for i, ml in enumerate(m.moe_layers):  # the same weights as the resident copy
        cuda.memcpy_dtoh(cache.host_gu[i], ml.gu_pool)
        cuda.memcpy_dtoh(cache.host_down[i], ml.down_pool)
        cuda.memset_d8(ml.router, 0, E * H * 2)
    cache.prime()
    setup = time.perf_counter() - t0
    for lanes in (1, 8):
        ids = scripted_routing(T + 8, lanes, args.reuse)
        bias = np.zeros((T + 8, L, lanes, E), np.float32)
        np.put_along_axis(bias, ids, 10.0 - 0.5 * np.arange(K), axis=-1)
        bias_dev = m.mem.alloc(bias.nbytes)
        cuda.memcpy_htod(bias_dev, bias)
        res = {}
        for name, moe in (("resident", m.moe), ("cached", DeviceMoE(m.cfg, m.op, m.moe.kern, [], m.ws, cache))):
            if name == "cached":
                moe.layers = [type(ml)(router=ml.router, router_bias=0, gu_pool=cache.gu_pool,
                                       down_pool=cache.down_pool, slot_of=cache.slot_of(i), gu_bias=0, down_bias=0)
                              for i, ml in enumerate(m.moe_layers)]  # fmt: skip
            else:
                moe.layers = list(m.moe_layers)
            saved, m.moe = m.moe, moe
            h0, m0 = cache.hits, cache.misses
            for t in range(T + 8):
                if t == 8:
                    s.synchronize()
                    start, h0, m0, b0 = time.perf_counter(), cache.hits, cache.misses, cache.bytes_moved
                for i in range(L):  # a round's router bias rows: [lanes, E] of token t, layer i
                    moe.layers[i].router_bias = bias_dev + ((t * L + i) * lanes * E) * 4
                    moe.layers[i].router_bias_ld = E
                m.round(lanes)
            s.synchronize()
            dt = time.perf_counter() - start
            res[name] = dt / T
            if name == "cached":
                hits, misses = cache.hits - h0, cache.misses - m0
                moved = cache.bytes_moved - b0
            m.moe = saved
        lines.append(
            f"| {lanes} | {1 / res['resident'] * lanes:,.0f} | {1 / res['cached'] * lanes:,.0f} | "
            f"{hits / max(1, hits + misses):.1%} | {misses / T:.1f} | {moved / T / 1e6:,.0f} |"
        )
    lines.append(f"\n(cache setup: {setup:.1f} s to pin and fill {L * E * 3 * INTER * H * 2 / 1e9:.0f} GB of host RAM)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reuse", type=float, default=0.8)
    ap.add_argument("--no-cache", action="store_true")
    args = ap.parse_args()
    import pycuda.driver as cuda

    from engine.cu import runtime

    with runtime.current():
        s = cuda.Stream()
        mem = runtime.Allocations()
        m = Model(cuda, s, mem)
        lines = ["", "Decode rounds, every expert resident, one CUDA graph per round (the MoE part alone: 48 x",
                 "`DeviceMoE.decode`; attention: the dense kernels; QK-norm and sampling left out):", "",
                 "| width | part | round ms | bytes read (GB) | bound ms @ 4.4 TB/s | x bound | distinct experts / layer |",
                 "|---|---|---|---|---|---|---|"]  # fmt: skip
        for rows in (1, 8):
            for parts in ("all", "moe", "attn"):
                t = time_graph(s, lambda rows=rows, parts=parts: m.round(rows, parts))
                nbytes = m.bytes(rows, parts)
                d = m.distinct_experts(rows).mean() if parts != "attn" else 0
                lines.append(f"| {rows} | {parts} | {t * 1e3:.3f} | {nbytes / 1e9:.2f} | {nbytes / BW * 1e3:.3f} | "
                             f"{t / (nbytes / BW):.2f} | {d:.1f} |")  # fmt: skip
        lines += ["", "The MoE part by launch (48 layers, one graph; each row adds a launch a layer):", "",
                  "| width | launches | ms | us / layer |", "|---|---|---|---|"]  # fmt: skip
        for rows in (1, 8):
            for name, t in breakdown(m, rows):
                lines.append(f"| {rows} | {name} | {t * 1e3:.3f} | {t / L * 1e6:.1f} |")
        if not args.no_cache:
            lines += ["", f"Expert cache: {L * E // 2} of {L * E} experts on the card, the rest in pinned host RAM; "
                      f"scripted routing (Zipf over experts, each previous choice kept with p = {args.reuse}), "
                      f"{args.tokens} rounds after 8 warm-up, uncaptured (one routing readback a layer):", "",
                      "| lanes | resident tok/s (uncaptured) | cached tok/s | hit rate | misses / round | MB moved / round |",
                      "|---|---|---|---|---|---|"]  # fmt: skip
            bench_cache(m, args, lines)
        name = cuda.Device(0).name()
        out = perfdoc.report(SECTION, machine=f"{name}, {platform.node()}", body=lines, write=args.write,
                             command=perfdoc.command_line("python3"))  # fmt: skip
        (ROOT / "bench" / "moe_section.md").write_text("\n".join(out) + "\n")
        mem.free()


if __name__ == "__main__":
    main()
