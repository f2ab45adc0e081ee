"""The CUDA backend: bf16 weights on the GPU, kernels from engine/cu, decode rounds
replayed from one CUDA graph per exact width 1..8.

Layout of what lives on the device:

* weights in bf16, q|k|v and gate|up fused into one matrix each ([out, in]); each head's q, k, v
  rows rope-interleaved and gate|up interleaved in 8-row groups, so the decode GEMV applies rope
  and SwiGLU in its epilogue;
* the paged KV pool, one allocation: ``[num_blocks][num_layers][2][block_size][kv_heads][head_dim]``
  bf16, so a block (all layers, K and V) is contiguous and a swap or copy is one memcpy;
* activations for up to ``PREFILL_CHUNK`` rows (prefill spans are run in chunks of that);
* two staging areas (decode round, prefill span): pinned host memory mirrored on the
  device. A decode graph reads tokens, positions, slots, block tables and sampling
  parameters from its staging area, so a replay needs only one small host-to-device
  copy before it and the sampled tokens copied back after it.

Nothing here imports PyCUDA at module import time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine import sampler
from engine.backend import Backend, DecodeLane, PrefillSpan, SampleRequest, StepOutput
from engine.memory import MemoryPlan
from engine.model_config import ModelConfig

MAX_LANES = 8
PREFILL_CHUNK = 2048
_GiB = 1 << 30
_MASK64 = (1 << 64) - 1


@dataclass
class _Layer:
    ln1: int
    ln2: int
    qkv: int
    qkv_bias: int  # 0 when the model has none
    o: int
    gate_up: int
    down: int


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self._allocs: list = []
        self.graphs: dict = {}
        self.dstage = self.pstage = None

    # --- load ------------------------------------------------------------------------------

    def load(self, config: ModelConfig, weights, *, block_size: int, kv_budget_bytes: int | None,
             host_kv_budget_bytes: int, max_context: int) -> MemoryPlan:  # fmt: skip
        from engine.cu import runtime

        with runtime.current():
            try:
                return self._load(config, weights, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context)
            except BaseException:
                self.unload()  # free what the failed load took
                raise

    def _load(self, cfg, weights, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context) -> MemoryPlan:
        import pycuda.driver as cuda

        from engine.cu.kernels import Kernels
        from engine.cu.runtime import Staging
        from engine.models.rope import rope_inv_freq

        self.config = cfg
        self.block_size, self.max_context = block_size, max_context
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.kern = Kernels(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)  # compiles everything now
        self.stream = cuda.Stream()
        hid, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        H, KVH = cfg.num_heads, cfg.num_kv_heads
        self.n_qkv = (H + 2 * KVH) * D
        # gate|up interleaved in 8-row groups, so a decode GEMV block holds matching gate and up
        # rows and applies SwiGLU in its epilogue (kernels.gate_up_act).
        self.gu_interleaved = inter % 8 == 0
        # Bytes of the next GEMV's weights the small kernels before it ask L2 to prefetch. Off by
        # default: 8-16 MB measured no change on the H200, 32 MB slower (docs/PERFORMANCE.md).
        self.l2_prefetch = int(float(os.environ.get("IGNIS_CUDA_L2_PREFETCH_MB", "0")) * (1 << 20))
        # Decode rounds of 5 kernels a layer (was 8): RMSNorm folded into the GEMVs (the residual's producer
        # writes bf16(h * w) and per-block sums of h^2, the consumer scales its rows), rope and the
        # KV write in the q|k|v GEMV's epilogue. 0: the 8-kernel path prefill uses (benchmarks).
        self.decode_fused = os.environ.get("IGNIS_CUDA_DECODE_FUSED", "1") != "0"

        # Weights.
        self._weights_bytes = 0
        self.embed = self._weights(weights, ["model.embed_tokens.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else self._weights(weights, ["lm_head.weight"])
        self.final_norm = self._weights(weights, ["model.norm.weight"])
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            proj = [p + f"self_attn.{x}_proj." for x in "qkv"]
            self.layers.append(
                _Layer(
                    ln1=self._weights(weights, [p + "input_layernorm.weight"]),
                    ln2=self._weights(weights, [p + "post_attention_layernorm.weight"]),
                    qkv=self._weights(weights, [x + "weight" for x in proj], rope_dim=D),
                    qkv_bias=(
                        self._weights(weights, [x + "bias" for x in proj], fp32=True, rope_dim=D)
                        if cfg.attention_bias
                        else 0
                    ),  # fmt: skip
                    o=self._weights(weights, [p + "self_attn.o_proj.weight"]),
                    gate_up=self._weights(
                        weights, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], interleave=self.gu_interleaved
                    ),  # fmt: skip
                    down=self._weights(weights, [p + "mlp.down_proj.weight"]),
                )
            )
        inv = np.ascontiguousarray(rope_inv_freq(cfg), dtype=np.float32)
        self.inv_freq = self._alloc(inv.nbytes)
        cuda.memcpy_htod(self.inv_freq, inv)

        # Activations (prefill chunks and decode rounds share them).
        T = PREFILL_CHUNK
        ws0 = self._allocated()
        self.x = self._alloc(T * hid * 4)
        self.xn = self._alloc(T * hid * 2)
        self.qkv = self._alloc(T * self.n_qkv * 4)
        self.q = self._alloc(T * H * D * 2)
        self.attn = self._alloc(T * H * D * 2)
        self.gu = self._alloc(T * 2 * inter * 4)
        self.act = self._alloc(T * inter * 2)
        self.ss = self._alloc(MAX_LANES * -(-hid // 16) * 4)  # fused RMSNorm: per-block sums of h^2
        self.logits = self._alloc(MAX_LANES * cfg.vocab_size * 4)
        from engine.cu.kernels import DECODE_SPLITS

        self.o_part = self._alloc(MAX_LANES * H * DECODE_SPLITS * D * 4)
        self.ml = self._alloc(MAX_LANES * H * DECODE_SPLITS * 2 * 4)
        self.logits_host = cuda.pagelocked_empty((MAX_LANES, cfg.vocab_size), np.float32)
        self.bt_stride = -(-max_context // block_size)
        self.pen_stride = min(cfg.vocab_size, max_context)
        L8, pen = MAX_LANES, self.pen_stride
        self.dstage = Staging({
            "tokens": (np.int32, L8), "positions": (np.int32, L8), "slots": (np.int32, L8),
            "sample_pos": (np.int32, L8), "seeds": (np.uint64, L8), "params": (np.float32, 8 * L8),
            "pen_num": (np.int32, L8), "out": (np.int32, L8), "block_tables": (np.int32, L8 * self.bt_stride),
            "pen_tokens": (np.int32, L8 * pen), "pen_counts": (np.int32, L8 * pen),
        })  # fmt: skip
        self.pstage = Staging({
            "sample_pos": (np.int32, 1), "seeds": (np.uint64, 1), "params": (np.float32, 8), "pen_num": (np.int32, 1),
            "out": (np.int32, 1), "block_table": (np.int32, self.bt_stride), "tokens": (np.int32, max_context),
            "positions": (np.int32, max_context), "slots": (np.int32, max_context),
            "pen_tokens": (np.int32, pen), "pen_counts": (np.int32, pen),
        })  # fmt: skip
        workspace = self._allocated() - ws0 + self.dstage.nbytes + self.pstage.nbytes

        # The KV pool from what is left on the card.
        self.block_bytes = block_size * cfg.num_layers * 2 * KVH * D * 2
        self.layer_stride = 2 * block_size * KVH * D  # elements between layers inside a block
        self.block_stride = cfg.num_layers * self.layer_stride  # elements between blocks
        if kv_budget_bytes is None:
            free, _total = cuda.mem_get_info()
            kv_budget_bytes = int(free * 0.92) - _GiB  # headroom for graphs, modules, the runtime
        num_blocks = int(kv_budget_bytes // self.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV budget {kv_budget_bytes} B holds no block of {self.block_bytes} B")
        self.num_blocks = num_blocks
        self.kv = self._alloc(num_blocks * self.block_bytes)
        cuda.memset_d8(self.kv, 0, num_blocks * self.block_bytes)
        self.num_host_blocks = int(host_kv_budget_bytes // self.block_bytes)
        self.host_kv = None  # pinned on the first swap_out

        # One graph per exact decode width.
        self._capture_graphs()
        self.stream.synchronize()
        self.plan = MemoryPlan(
            budget_bytes=self._weights_bytes + workspace + num_blocks * self.block_bytes,
            weights_bytes=self._weights_bytes,
            workspace_bytes=int(workspace),
            kv_bytes=num_blocks * self.block_bytes,
            block_size=block_size,
            num_blocks=num_blocks,
            host_kv_bytes=self.num_host_blocks * self.block_bytes,
            num_host_blocks=self.num_host_blocks,
        )
        return self.plan

    def _alloc(self, nbytes: int) -> int:
        import pycuda.driver as cuda

        a = cuda.mem_alloc(max(int(nbytes), 256))
        self._allocs.append((a, int(nbytes)))
        return int(a)

    def _allocated(self) -> int:
        return sum(n for _, n in self._allocs)

    def _weights(self, weights, names: list[str], fp32: bool = False, interleave: bool = False,
                 rope_dim: int = 0) -> int:  # fmt: skip
        """Upload tensors ``names`` concatenated along dim 0 as bf16 (fp32 for biases); with
        ``interleave`` the two (gate, up) are interleaved in 8-row groups instead; with ``rope_dim``
        each part's heads are rope-interleaved (``interleave_rope``).

        Values are float32 numpy arrays (the interface); torch tensors are accepted too
        (already-on-GPU ones are copied device to device)."""
        import pycuda.driver as cuda

        from engine.cu.kernels import interleave_gate_up, interleave_rope

        parts = [weights[n] for n in names]
        if rope_dim:
            parts = [interleave_rope(p, rope_dim) for p in parts]
        if interleave:
            parts = [interleave_gate_up(*parts)]
        nbytes = sum(int(np.prod(p.shape)) for p in parts) * (4 if fp32 else 2)
        dst = self._alloc(nbytes)
        self._weights_bytes += nbytes
        off = 0
        for p in parts:
            if _is_torch(p):
                import torch

                t = p.detach().to(torch.float32 if fp32 else torch.bfloat16).contiguous()
                if t.is_cuda:
                    torch.cuda.synchronize()
                    cuda.memcpy_dtod(dst + off, t.data_ptr(), t.numel() * t.element_size())
                else:
                    cuda.memcpy_htod(dst + off, t.view(torch.int32 if fp32 else torch.int16).numpy())
                off += t.numel() * t.element_size()
            else:
                from engine.cu.kernels import to_bf16

                a = np.ascontiguousarray(p, dtype=np.float32) if fp32 else to_bf16(p)
                cuda.memcpy_htod(dst + off, a)
                off += a.nbytes
        return dst

    # --- the forward pass ------------------------------------------------------------------

    def _layers(self, rows: int, tokens: int, positions: int, slots: int, attend, decode: bool = False) -> None:
        """Embed ``rows`` tokens and run every layer; leaves the residual stream in ``self.x``.
        In a decode round the small kernels also start L2 prefetches of the next GEMV's weights."""
        c, k, s = self.config, self.kern, self.stream
        hid, inter, H, KVH, D = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        cap = self.l2_prefetch if decode else 0

        def pf(ptr: int, nbytes: int) -> tuple[int, int]:
            return (ptr, min(cap, nbytes)) if cap > 0 else (0, 0)

        k.embed(s, tokens, self.embed, self.x, rows, hid)
        for i, L in enumerate(self.layers):
            cache = self.kv + i * self.layer_stride * 2
            k.rmsnorm(s, self.x, L.ln1, self.xn, rows, hid, c.rms_norm_eps, prefetch=pf(L.qkv, self.n_qkv * hid * 2))
            k.linear(s, self.xn, L.qkv, L.qkv_bias, self.qkv, rows, self.n_qkv, hid)
            k.rope_kv_write(s, self.qkv, positions, slots, self.inv_freq, self.q, cache, rows, H, KVH,
                            self.block_size, self.block_stride, prefetch=pf(L.o, hid * H * D * 2),
                            interleaved=True)  # fmt: skip
            attend(cache)
            k.linear(s, self.attn, L.o, 0, self.x, rows, hid, H * D, accumulate=True)
            k.rmsnorm(s, self.x, L.ln2, self.xn, rows, hid, c.rms_norm_eps, prefetch=pf(L.gate_up, 4 * inter * hid))
            if self.gu_interleaved:
                k.gate_up_act(s, self.xn, L.gate_up, self.gu, self.act, rows, inter, hid)
            else:
                k.linear(s, self.xn, L.gate_up, 0, self.gu, rows, 2 * inter, hid)
                k.swiglu(s, self.gu, self.act, inter, rows)
            k.linear(s, self.act, L.down, 0, self.x, rows, hid, inter, accumulate=True)

    def _decode_fused(self, rows: int, p: dict, attend) -> None:
        """A decode round's layers and LM head in 5 kernels a layer (Kernels.qkv_rope, attention,
        o, gate|up, down): each residual producer (embed, the o and down GEMVs) also writes the next
        RMSNorm's inputs into ``xn`` / ``ss``, and its consumer scales its rows (gemv.cu)."""
        c, k, s = self.config, self.kern, self.stream
        hid, inter, H, KVH, D, eps = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                      c.rms_norm_eps)  # fmt: skip
        norms = [L.ln1 for L in self.layers[1:]] + [self.final_norm]
        first = self.layers[0].ln1 if self.layers else self.final_norm
        nparts = k.embed(s, p["tokens"], self.embed, self.x, rows, hid, norm_out=(first, self.xn, self.ss))
        for i, L in enumerate(self.layers):
            cache = self.kv + i * self.layer_stride * 2
            k.qkv_rope(s, self.xn, L.qkv, L.qkv_bias, self.q, rows, H, KVH, hid, p["positions"], p["slots"],
                       self.inv_freq, cache, self.block_size, self.block_stride, ss_in=(self.ss, nparts), eps=eps)  # fmt: skip
            attend(cache)
            nparts = k.linear(s, self.attn, L.o, 0, self.x, rows, hid, H * D, accumulate=True,
                              norm_out=(L.ln2, self.xn, self.ss))  # fmt: skip
            if self.gu_interleaved:
                k.gate_up_act(s, self.xn, L.gate_up, self.gu, self.act, rows, inter, hid, ss_in=(self.ss, nparts),
                              eps=eps)  # fmt: skip
            else:
                k.linear(s, self.xn, L.gate_up, 0, self.gu, rows, 2 * inter, hid, ss_in=(self.ss, nparts), eps=eps)
                k.swiglu(s, self.gu, self.act, inter, rows)
            nparts = k.linear(s, self.act, L.down, 0, self.x, rows, hid, inter, accumulate=True,
                              norm_out=(norms[i], self.xn, self.ss))  # fmt: skip
        k.linear(s, self.xn, self.lm_head, 0, self.logits, rows, c.vocab_size, hid, ss_in=(self.ss, nparts), eps=eps)

    def _head(self, rows: int, x_row: int, decode: bool = False) -> None:
        """Final norm of ``rows`` residual rows from row ``x_row``, then the LM head into ``self.logits``."""
        c = self.config
        x = self.x + x_row * c.hidden_size * 4
        nb = min(self.l2_prefetch, c.vocab_size * c.hidden_size * 2) if decode else 0
        self.kern.rmsnorm(self.stream, x, self.final_norm, self.xn, rows, c.hidden_size, c.rms_norm_eps,
                          prefetch=(self.lm_head, nb) if nb > 0 else (0, 0))  # fmt: skip
        self.kern.linear(self.stream, self.xn, self.lm_head, 0, self.logits, rows, c.vocab_size, c.hidden_size)

    def _sample(self, st, rows: int) -> None:
        k, s, V = self.kern, self.stream, self.config.vocab_size
        p = st.ptr
        k.penalties(s, self.logits, V, p["params"], p["pen_tokens"], p["pen_counts"], p["pen_num"],
                    self.pen_stride, rows)  # fmt: skip
        k.sample(s, self.logits, V, p["params"], p["seeds"], p["sample_pos"], p["out"], rows)

    def _decode_body(self, rows: int) -> None:
        st, c = self.dstage, self.config
        p = st.ptr

        def attend(cache: int) -> None:
            self.kern.decode_attention(self.stream, self.q, p["positions"], p["block_tables"], self.bt_stride, cache,
                                       self.block_stride, self.block_size, c.num_kv_heads, self.o_part, self.ml,
                                       self.attn, rows)  # fmt: skip

        if self.decode_fused:
            self._decode_fused(rows, p, attend)
        else:
            self._layers(rows, p["tokens"], p["positions"], p["slots"], attend, decode=True)
            self._head(rows, 0, decode=True)
        self._sample(st, rows)

    def _capture_graphs(self) -> None:
        """(Re)capture the decode graph of every width 1..MAX_LANES (benchmarks re-capture after
        changing a kernel setting)."""
        from engine.cu.runtime import Graph

        self.stream.synchronize()
        for g in self.graphs.values():
            g.destroy()
        self.graphs = {}
        v = self.dstage.view
        v["params"][:] = 0.0  # greedy
        v["sample_pos"][:] = 1
        self.dstage.upload(self.stream, "tokens", "block_tables")
        for m in range(1, MAX_LANES + 1):
            self._decode_body(m)  # warm-up: loads every kernel before capture (writes only block 0)
            self.graphs[m] = Graph(self.stream, lambda m=m: self._decode_body(m))
        self.stream.synchronize()

    # --- staging ---------------------------------------------------------------------------

    def _stage_sample(self, st, row: int, req: SampleRequest, position: int) -> bool:
        """Write row ``row``'s sampling inputs; returns whether it has penalties."""
        p = req.params
        st.view["params"][row * 8 : row * 8 + 8] = (
            p.temperature, p.top_p, float(p.top_k), p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, 0.0,
        )  # fmt: skip
        st.view["seeds"][row] = int(req.seed) & _MASK64
        st.view["sample_pos"][row] = position
        ids, counts = _penalty_list(req, self.config.vocab_size)
        n = min(len(ids), self.pen_stride)
        st.view["pen_num"][row] = n
        if n:
            st.view["pen_tokens"][row * self.pen_stride : row * self.pen_stride + n] = ids[:n]
            st.view["pen_counts"][row * self.pen_stride : row * self.pen_stride + n] = counts[:n]
        return n > 0

    def _slots(self, block_table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        bt = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if len(positions) and (idx.max() >= len(bt) or positions.max() >= self.max_context):
            raise ValueError(f"block table of {len(bt)} blocks does not reach position {int(positions.max())}")
        return bt[idx] * self.block_size + positions % self.block_size

    def _host_sample(self, row: np.ndarray, req: SampleRequest, position: int):
        """A grammar-constrained row is drawn on the host: its mask comes from the
        request's matcher, which lives in Python. ``row`` already carries the
        device's penalties, so the host sampler applies none of its own; the draw
        uses the same (seed, position) Philox as the device would."""
        p = req.params
        neutral = replace(req, params=replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
        token, lp = sampler.sample_row(row, neutral, position)
        return token, lp

    def _logprob(self, row: np.ndarray, req: SampleRequest, token: int):
        x = np.array(row, dtype=np.float32)
        if not req.params.is_greedy:
            x = sampler.process_logits(x, req.params)
        return sampler.token_logprob(x, token, req.num_logprobs)

    # --- the step interface ----------------------------------------------------------------

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        from engine.cu import runtime

        with runtime.current():
            self._prefill(span, out)

    def _prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        import pycuda.driver as cuda

        n, start = len(span.token_ids), span.start_pos
        if n == 0:
            raise ValueError("empty prefill span")
        if span.want_prompt_logprobs is not None:  # supports_prompt_logprobs is False: the scheduler refuses first
            raise ValueError("prompt logprobs are not available on the CUDA backend")
        st, s = self.pstage, self.stream
        positions = np.arange(start, start + n, dtype=np.int64)
        slots = self._slots(span.block_table, positions)
        if len(span.block_table) > self.bt_stride:
            raise ValueError(f"block table longer than max_context ({self.bt_stride} blocks)")
        v = st.view
        v["tokens"][:n] = np.asarray(span.token_ids, dtype=np.int32)
        v["positions"][:n] = positions
        v["slots"][:n] = slots
        v["block_table"][: len(span.block_table)] = np.asarray(span.block_table, dtype=np.int32)
        st.upload(s, "block_table", nbytes=4 * len(span.block_table))
        for name in ("tokens", "positions", "slots"):
            st.upload(s, name, nbytes=4 * n)
        c, p = self.config, st.ptr
        for c0 in range(0, n, PREFILL_CHUNK):
            rows = min(PREFILL_CHUNK, n - c0)

            def attend(cache: int, rows=rows, c0=c0) -> None:
                self.kern.prefill_attention(s, self.q, p["block_table"], cache, self.block_stride, self.block_size,
                                            c.num_kv_heads, rows, start + c0, self.attn)  # fmt: skip

            self._layers(rows, p["tokens"] + 4 * c0, p["positions"] + 4 * c0, p["slots"] + 4 * c0, attend)
        if span.sample is None and not span.want_logits:
            s.synchronize()
            return
        self._head(1, rows - 1)
        if span.want_logits:  # raw logits, queued before the penalties touch them
            cuda.memcpy_dtoh_async(self.logits_host[0], self.logits, s)
        req = span.sample
        if req is not None:
            if self._stage_sample(st, 0, req, start + n):
                st.upload(s, "pen_tokens", "pen_counts")
            st.upload(s, "sample_pos", "out")
            self._sample(st, 1)
            cuda.memcpy_dtoh_async(v["out"], p["out"], s)
            if req.want_logprobs or req.constraint is not None:
                cuda.memcpy_dtoh_async(self.logits_host[1], self.logits, s)
        s.synchronize()
        if span.want_logits:
            out.prefill_logits = self.logits_host[0].copy()
        if req is not None:
            if req.constraint is not None:
                out.prefill_token, out.prefill_logprob = self._host_sample(self.logits_host[1], req, start + n)
                return
            out.prefill_token = int(v["out"][0])
            if req.want_logprobs:
                out.prefill_logprob = self._logprob(self.logits_host[1], req, out.prefill_token)

    def decode_round(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        from engine.cu import runtime

        with runtime.current():
            for g in range(0, len(lanes), MAX_LANES):
                self._decode_group(lanes[g : g + MAX_LANES], out)

    def _decode_group(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        import pycuda.driver as cuda

        st, s, M = self.dstage, self.stream, len(lanes)
        v, stride = st.view, self.bt_stride
        any_pen = False
        bs = self.block_size
        tokens, positions, slots = v["tokens"], v["positions"], v["slots"]
        for i, ln in enumerate(lanes):  # plain Python per lane: this is on every round's critical path
            bt, pos = ln.block_table, int(ln.position)
            nb = len(bt)
            if nb > stride:
                raise ValueError(f"block table longer than max_context ({stride} blocks)")
            if not 0 <= pos < self.max_context or pos // bs >= nb:
                raise ValueError(f"block table of {nb} blocks does not reach position {pos}")
            tokens[i] = ln.token_id
            positions[i] = pos
            slots[i] = int(bt[pos // bs]) * bs + pos % bs
            v["block_tables"][i * stride : i * stride + nb] = bt
            any_pen |= self._stage_sample(st, i, ln.sample, pos + 1)
        st.upload(s, "tokens", "pen_num")
        st.upload(s, "block_tables", nbytes=4 * M * stride)
        if any_pen:
            st.upload(s, "pen_tokens", nbytes=4 * M * self.pen_stride)
            st.upload(s, "pen_counts", nbytes=4 * M * self.pen_stride)
        self.graphs[M].launch()
        cuda.memcpy_dtoh_async(v["out"], st.ptr["out"], s)
        want = {i for i, ln in enumerate(lanes) if ln.sample.want_logprobs or ln.sample.constraint is not None}
        if want:
            cuda.memcpy_dtoh_async(self.logits_host[:M], self.logits, s)
        s.synchronize()
        tokens = [int(t) for t in v["out"][:M]]
        for i, ln in enumerate(lanes):
            lp = None
            if ln.sample.constraint is not None:
                tokens[i], lp = self._host_sample(self.logits_host[i], ln.sample, int(ln.position) + 1)
            elif i in want:
                lp = self._logprob(self.logits_host[i], ln.sample, tokens[i])
            out.decode_logprobs.append(lp)
        out.decode_tokens.extend(tokens)

    # --- KV pages --------------------------------------------------------------------------

    def _host_kv(self):
        import pycuda.driver as cuda

        if self.host_kv is None:
            if self.num_host_blocks < 1:
                raise RuntimeError("no host KV tier (host_kv_budget_bytes too small)")
            self.host_kv = cuda.pagelocked_empty(self.num_host_blocks * self.block_bytes, np.uint8)
        return self.host_kv

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        import pycuda.driver as cuda

        from engine.cu import runtime

        with runtime.current():
            host, bb = self._host_kv(), self.block_bytes
            for dev, hb in pairs:
                cuda.memcpy_dtoh_async(host[hb * bb : (hb + 1) * bb], self.kv + dev * bb, self.stream)
            self.stream.synchronize()

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        import pycuda.driver as cuda

        from engine.cu import runtime

        with runtime.current():
            host, bb = self._host_kv(), self.block_bytes
            for hb, dev in pairs:
                cuda.memcpy_htod_async(self.kv + dev * bb, host[hb * bb : (hb + 1) * bb], self.stream)
            self.stream.synchronize()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        import pycuda.driver as cuda

        from engine.cu import runtime

        with runtime.current():
            bb = self.block_bytes
            for src, dst in pairs:
                cuda.memcpy_dtod_async(self.kv + dst * bb, self.kv + src * bb, bb, self.stream)
            self.stream.synchronize()

    def unload(self) -> None:
        if not self._allocs and not self.graphs:
            return
        from engine.cu import runtime

        with runtime.current():
            self.stream.synchronize()
            for g in self.graphs.values():
                g.destroy()
            self.graphs = {}
            for st in (self.dstage, self.pstage):
                if st is not None:
                    st.free()
            self.dstage = self.pstage = None
            for a, _ in self._allocs:
                a.free()
            self._allocs = []
            self.host_kv = self.logits_host = None
            self.plan = None


def _penalty_list(req: SampleRequest, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids the penalties touch and their counts among generated tokens."""
    p = req.params
    rep = p.repetition_penalty != 1.0
    po = bool(p.presence_penalty or p.frequency_penalty)
    empty = np.zeros(0, np.int32)
    if not (rep or po):
        return empty, empty
    out_ids, out_counts = np.unique(np.asarray(req.output_token_ids, np.int64), return_counts=True)
    if rep:
        ids = np.unique(np.concatenate([np.asarray(req.prompt_token_ids, np.int64), out_ids]))
        counts = np.zeros(len(ids), np.int64)
        if po and len(out_ids):
            counts[np.searchsorted(ids, out_ids)] = out_counts
    else:
        ids, counts = out_ids, out_counts
    keep = (ids >= 0) & (ids < vocab)
    return ids[keep].astype(np.int32), counts[keep].astype(np.int32)
