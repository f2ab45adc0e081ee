"""CudaBackend: the step interface over the pieces of this package.

A load uploads the weights (``weights``: a GGUF's block-quantized matrices as stored,
``weights_as_stored``), allocates the activations for up to
``PREFILL_CHUNK`` rows (``forward.Workspace``) and two staging areas (decode round,
prefill span), sizes the KV pool from what is left (``kv``), and captures one decode
graph per width (``graphs``: 1..64 rows, 1..8 with quantized matrices). A prefill span
runs in chunks through ``Forward``, a prefill group's spans as one pass where each gets its
own bits there (``prefill_rows``); a decode round stages its lanes (a speculating
lane's verify rows among them) and replays its width's graph; both sample on the
device (``sampling``). A vision-language model (qwen2_5_vl) also uploads its tower
(``vision``): a span encodes each image it reaches once and its chunks take the image's
rows in place of the placeholders' embeddings; its prefill rows stage three rope
positions each, its decode rows ``rope_positions`` (position + the lane's rope delta).
Every call pushes the device's primary context, so the engine may call from its step
thread. Nothing here imports PyCUDA at module import time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from engine.backend import PENDING, Backend, DecodeLane, PrefillSpan, StepOutput, StepPlan
from engine.backends.cuda import sampling
from engine.backends.cuda.forward import MAX_LANES, PREFILL_CHUNK, QUANT_LANES, Forward, Workspace, check_model
from engine.config import CudaTuning
from engine.cu.quant import QUANT_FORMATS, quant_act_bytes
from engine.memory import MemoryPlan, dequant_scratch_bytes, workspace_bytes
from engine.model_config import ModelConfig
from engine.models.ops import MRope


class CudaBackend(Backend):
    name = "cuda"
    # Decode and prefill attention never read a KV block before a sliding layer's window
    # (attention_decode.cu / attention_prefill.cu), so the scheduler may release those pages.
    releases_window_pages = True
    # A speculating lane's rows are rows of the round (tests/kernels/test_cuda_spec.py): up to
    # ``cuda.round_rows`` (16; the kernels and graphs take 64), 8 once a load finds quantized
    # matrices or MoE layers (``_load``).
    max_round_rows = MAX_LANES
    # The GGUF block types the loader keeps as stored (engine.loaders.gguf.QuantizedTensor): decode
    # GEMVs read them (engine/cu/gemv_q.cu); F16 / BF16 / F32 arrive as floats and go up as bf16;
    # MXFP4 comes as an Mxfp4Tensor (experts as stored, see takes_mxfp4).
    weights_as_stored = frozenset(QUANT_FORMATS) | {"MXFP4"}
    # fp8 matrices (engine.loaders.fp8.Fp8Tensor, per-output-channel or 128 x 128 tile scales) go up as
    # e4m3 bytes and fp32 scales; decode reads them in gemv_q.cu, prefill dequantizes them for the GEMM.
    takes_fp8 = True
    # bf16 checkpoint tensors arrive as stored (engine.loaders.bf16) and go up as their bits.
    takes_bf16 = True
    # MXFP4 experts (gpt-oss) arrive as engine.loaders.mxfp4.Mxfp4Tensor and go up as stored
    # (engine/cu/mxfp4.py, read by moe_gemv.cu's MOE_MX build); any other MXFP4 matrix is dequantized.
    takes_mxfp4 = True
    # Rounds planned ahead (engine/run_ahead.py, docs/CUDA.md): a PENDING row's token is read on the
    # device from the round before's ``out`` (the embed kernel's ``src`` rows); with ``step(defer=True)``
    # a plain round returns once queued, and ``finish`` waits for its tokens: the next round is queued
    # on the card behind it before the host reads them.
    supports_async_rounds = True
    defers_rounds = True
    # prefill_group: a group's spans of more rows than the GEMV takes run as one pass of the forward
    # (prefill_rows.py), each with the bits it gets alone.
    prefills_together = True
    # nvcc runs a load keeps going at once while the weights upload (engine.cu.launch.compiling): None,
    # the machine's CPUs up to 16; 0, none: each module compiles when Kernels asks for it, before the
    # upload starts (the order before; bench/bench_load.py's serial column).
    compile_workers: int | None = None

    def __init__(self, tuning: CudaTuning | None = None) -> None:
        super().__init__()
        self.tuning = tuning or CudaTuning()
        self.mem = None
        self.graphs = None
        self.dstage = self.pstage = None
        self.vision = None
        self._rows_before: dict[int, int] = {}  # seq_id -> its row in the last round, whose token is on the device
        self._feed_from: dict[int, int] = {}  # _rows_before as the step began
        self._feed: dict[int, int] = {}  # this round's PENDING rows -> the row of the round before they feed
        self._in_flight: dict[int, _Round] = {}  # staging set -> the deferred round that used it
        self._defer = False

    # --- load ------------------------------------------------------------------------------

    def load(self, config: ModelConfig, weights, *, block_size: int, kv_budget_bytes: int | None,
             host_kv_budget_bytes: int, max_context: int) -> MemoryPlan:  # fmt: skip
        from engine.cu import runtime
        from engine.cu.launch import compiling

        with runtime.current():
            try:
                # The kernels compile on a pool of nvcc runs while the weights go up; _load binds them
                # (each cubin loaded into this thread's context, its functions prepared) before it
                # captures the graphs. A compile error raises from the bind; the block ends the pool.
                with compiling(self.compile_workers) as compiles:
                    return self._load(config, weights, block_size, kv_budget_bytes, host_kv_budget_bytes,
                                      max_context, compiles)  # fmt: skip
            except BaseException:
                self.unload()  # free what the failed load took
                raise

    def _load(self, cfg, weights, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context,
              compiles) -> MemoryPlan:  # fmt: skip
        import pycuda.driver as cuda

        from engine.backends.cuda.graphs import GraphRunner, decode_fields
        from engine.backends.cuda.kv import KVPool
        from engine.backends.cuda.prefill_rows import prefill_fields
        from engine.backends.cuda.weights import quant_formats, upload
        from engine.cu.kernels import gemv_rows
        from engine.cu.runtime import Allocations, Staging
        from engine.models import definition

        defn = definition(cfg.arch)
        head, blocks, embedding = defn.head(cfg), defn.blocks(cfg), defn.embedding(cfg)
        check_model(blocks, head, embedding)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.config = cfg
        self.block_size, self.max_context = block_size, max_context
        free_at_load = cuda.mem_get_info()[0]  # model.gpu_budget's fraction is of this
        self.mem = Allocations()
        self.formats = quant_formats(weights)
        self.kern = self._kernels()  # every compile starts on the pool (in the serial order: done now)
        moe_kern, vision_kern = self._model_kernels(cfg, blocks, weights)  # theirs too, before the upload
        self.stream = cuda.Stream()
        self.weights = upload(cfg, blocks, head, weights, self.mem, embed_scale=embedding.scale, kern=self.kern,
                              pinned=self.tuning.pinned_upload)  # fmt: skip
        self.moe, moe_bytes = self._upload_moe(cfg, blocks, weights, moe_kern)
        post_norms = any(b.attn_post_norm is not None or b.mlp_post_norm is not None for b in blocks)
        self.ws = Workspace.allocate(cfg, self.mem, post_norms=post_norms)
        self.vision = self._upload_vision(cfg, weights, vision_kern)
        self.mrope = any(isinstance(b.attention.rope, MRope) for b in blocks)
        # Prefill dequantizes a quantized matrix here for the GEMM (decode rounds read the blocks).
        scratch = dequant_scratch_bytes(cfg) if self.weights.quantized else 0
        self.scratch = (self.mem.alloc(scratch), scratch) if scratch else (0, 0)
        self.kern.scratch, self.kern.scratch_bytes = self.scratch
        # cuda.quant_activations' int8 x (quant_act.cu), 8 rows of the largest K: allocated whenever a
        # matrix keeps blocks (a few hundred KB), so retune can switch the key on before recapturing.
        qk = self.weights.quant_k
        qact = quant_act_bytes(qk) if qk else 0
        self.qact = (self.mem.alloc(qact), qact) if qact else (0, 0)
        if qact:
            cuda.memset_d8(self.qact[0], 0, qact)  # rows past a call's M of the scales: finite
        self.kern.qact, self.kern.qact_bytes = self.qact
        self.logits_host = cuda.pagelocked_empty((MAX_LANES, cfg.vocab_size), np.float32)
        self.bt_stride = -(-max_context // block_size)
        self.pen_stride = pen = min(cfg.vocab_size, max_context)
        self.dstage = Staging(decode_fields(MAX_LANES, self.bt_stride, pen), sets=2)  # rounds planned ahead
        self.pstage = Staging(prefill_fields(MAX_LANES, self.bt_stride, max_context, pen, mrope=self.mrope))
        self.kv = KVPool(cfg, block_size, self.mem, kv_budget_bytes, host_kv_budget_bytes,
                         gpu_budget=self.tuning.gpu_budget, free_at_load=free_at_load)  # fmt: skip
        self.forward = Forward(cfg, self.kern, self.stream, self.weights, self.ws, self.kv.layout, moe=self.moe)
        eager = self.moe is not None and not self.moe.graph_safe  # the expert cache reads routing back
        # gemv_q.cu and the expert kernels take one group of 8 rows; gemv.cu takes 64.
        narrow = self.weights.quantized or gemv_rows(self.weights.lm_head) < MAX_LANES or self.moe is not None

        def cap(rows: int) -> int:
            return QUANT_LANES if narrow else max(QUANT_LANES, min(rows, MAX_LANES))

        self.max_round_rows = cap(max(self.tuning.round_rows, self.tuning.known_rows))  # cuda.known_rows: wider
        self.max_draft_rows = cap(self.tuning.round_rows)  # drafts stop at cuda.round_rows
        # A prefill span past a plain round's rows runs the GEMM (alone and in a group pass alike), which
        # is faster there than a wide GEMV variant; cuda.known_rows widens decode rounds only.
        self.prefill_gemv_rows = cap(self.tuning.round_rows)
        compiles.bind()  # waits for the cubins still compiling; the graphs launch every kernel
        self.graphs = GraphRunner(self.stream, self.dstage, self._decode_body, self.max_round_rows, eager=eager)
        self._capture()
        # The workspace figure is engine.memory's formula (the same one the switch precheck uses):
        # activations of PREFILL_CHUNK rows plus MAX_LANES rows of logits.
        work = workspace_bytes(cfg, rows=PREFILL_CHUNK, logit_rows=MAX_LANES) + scratch
        if self.moe is not None:
            work += self.moe.ws.mx_scratch_bytes  # MXFP4 experts through the bf16 scratch (0 when read as tiles)
        kv_bytes = self.kv.num_blocks * self.kv.block_bytes
        weight_bytes = self.weights.nbytes + moe_bytes
        if self.vision is not None:
            weight_bytes += self.vision.nbytes
            work += self.vision.workspace_bytes
        self.plan = MemoryPlan(
            budget_bytes=weight_bytes + work + kv_bytes,
            weights_bytes=weight_bytes,
            workspace_bytes=work,
            kv_bytes=kv_bytes,
            block_size=block_size,
            num_blocks=self.kv.num_blocks,
            host_kv_bytes=self.kv.num_host_blocks * self.kv.block_bytes,
            num_host_blocks=self.kv.num_host_blocks,
        )
        return self.plan

    def stats(self) -> dict:
        """The expert cache's counters (a sparse model behind ``cuda.expert_budget``)."""
        moe = getattr(self, "moe", None)
        if moe is None:
            return {}
        total = self.config.num_layers * moe.op.num_experts
        cache = moe.cache
        if cache is None:
            return {"experts": {"resident": total, "total": total, "hits": 0, "misses": 0, "bytes_moved": 0}}
        return {"experts": {"resident": cache.slots, "total": total, "hits": cache.hits, "misses": cache.misses,
                            "bytes_moved": cache.bytes_moved}}  # fmt: skip

    def _model_kernels(self, cfg, blocks, weights):
        """(``MoEKernels`` of a sparse model (built for MXFP4 experts when ``weights`` hold them) or None,
        ``VisionKernels`` of a vision-language one or None)."""
        from engine.models.ops import MoE

        moe = vision = None
        if blocks and isinstance(blocks[0].mlp, MoE):
            from engine.backends.cuda.expert_cache import is_mxfp4
            from engine.backends.cuda.moe import MoEKernels

            moe = MoEKernels(self.tuning.kernel_cache_dir, mx=is_mxfp4(cfg, weights))
        if cfg.vision is not None:
            from engine.cu.vision import VisionKernels

            vision = VisionKernels(cfg.vision.head_dim, self.tuning.kernel_cache_dir)
        return moe, vision

    def _upload_moe(self, cfg, blocks, weights, kern):
        """A sparse model's experts (every layer's, engine/backends/cuda/moe.py): resident, or behind
        the expert cache when ``cuda.expert_budget`` is smaller than all of them, run by ``kern``
        (``MoEKernels``). Returns the
        ``DeviceMoE`` (None for a dense model) and the device bytes its experts and routers take."""
        from engine.models.ops import MoE

        if not blocks or not isinstance(blocks[0].mlp, MoE):
            return None, 0
        from engine.backends.cuda.expert_cache import expert_nbytes, upload_moe
        from engine.backends.cuda.moe import DeviceMoE, MoEWorkspace

        op, budget = blocks[0].mlp, self.tuning.expert_budget or None
        # bf16 experts (GGUF blocks and fp8 dequantized), or MXFP4 ones as stored
        layers, cache = upload_moe(cfg, op, weights, self.mem, gpu_budget=budget, kern=kern)  # (primes the cache)
        ws = MoEWorkspace(op.num_experts, op.top_k, cfg.hidden_size, cfg.moe_intermediate_size, PREFILL_CHUNK,
                          self.mem, mx=kern.mx, scratch=kern.mx and not kern.mx_tiles)  # fmt: skip
        resident = cfg.num_layers * op.num_experts if cache is None else cache.slots
        logging.getLogger("ignis.engine").info(
            "ignis.runtime.experts", extra={"resident": resident, "total": cfg.num_layers * op.num_experts}
        )
        return DeviceMoE(cfg, op, kern, layers, ws, cache), resident * expert_nbytes(cfg, kern.mx)

    def _upload_vision(self, cfg, weights, vk):
        """The vision tower (engine/backends/cuda/vision.py, its kernels ``vk``) of a vision-language
        model, else None."""
        if cfg.vision is None:
            return None
        from engine.backends.cuda.vision import VisionTower

        return VisionTower(cfg.vision, weights, self.mem, self.kern, self.tuning.kernel_cache_dir, vk=vk)

    def _kernels(self):
        from engine.cu.kernels import Kernels

        c, t = self.config, self.tuning
        return Kernels(c.head_dim, c.num_heads // c.num_kv_heads, u2_below=t.gemv_u2_below,
                       cache_dir=t.kernel_cache_dir, formats=self.formats, pdl=t.pdl,
                       wide_min_n=t.gemv_wide_min_n, quant_act=t.quant_activations,
                       quant_persist=t.quant_persist, gemv_pair=t.gemv_pair, decode_lanes=t.decode_lanes,
                       fp8_gemm=t.fp8_gemm, narrow_tiles=t.narrow_tiles)  # fmt: skip

    def retune(self, tuning: CudaTuning) -> None:
        """Switch kernel settings on a loaded model and recapture the decode graphs (benchmarks)."""
        from engine.cu import runtime
        from engine.cu.launch import compiling

        with runtime.current():
            self.tuning = tuning
            with compiling(self.compile_workers):  # in parallel; bound as the block ends
                self.kern = self.forward.kern = self._kernels()
            self.kern.scratch, self.kern.scratch_bytes = self.scratch
            self.kern.qact, self.kern.qact_bytes = self.qact
            self._capture()

    def _capture(self) -> None:
        """(Re)capture the decode graphs with the GEMV taking a round's widest rows, then leave the
        GEMV's cap at ``prefill_gemv_rows`` for the prefill passes, which run eagerly (a decode round
        run eagerly, MoE's, is 8 rows wide under either cap)."""
        self.kern.gemv_cap = self.max_round_rows
        self.graphs.capture()
        self.kern.gemv_cap = self.prefill_gemv_rows

    def _decode_body(self, rows: int) -> None:
        """Every launch of a decode round of ``rows`` lanes (what a graph holds)."""
        self.forward.decode(rows, self.dstage.ptr, self.bt_stride)
        sampling.sample_on_device(self.kern, self.stream, self.ws.logits, self.config.vocab_size, self.dstage,
                                  self.pen_stride, rows)  # fmt: skip

    # --- the step interface ----------------------------------------------------------------

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        from engine.cu import runtime

        with runtime.current():
            self._prefill(span, out)

    def prefill_group(self, spans: Sequence[PrefillSpan], outs: Sequence[StepOutput]) -> None:
        """Several whole prompts in one step (engine/prefill_group.py): the spans ``prefill_rows.layout``
        takes run as one pass of the forward (each weight streamed once for all their rows, attention
        span by span) and draw in one sampling call; the others prefill one by one. Each span gets the
        bits its ``prefill`` alone gets (engine/backends/cuda/prefill_rows.py says why)."""
        from engine.backends.cuda.prefill_rows import layout
        from engine.cu import runtime

        with runtime.current():
            rows = layout(spans, narrow=self.prefill_gemv_rows, max_rows=min(PREFILL_CHUNK, self.max_context),
                          max_spans=MAX_LANES)  # fmt: skip
            together = {r.index for r in rows}
            for i, (span, out) in enumerate(zip(spans, outs, strict=True)):
                if i not in together:
                    self._prefill(span, out)
            if rows:
                self._prefill_pass(spans, outs, rows)

    def _prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        import pycuda.driver as cuda

        n, start = len(span.token_ids), span.start_pos
        if n == 0:
            raise ValueError("empty prefill span")
        if span.want_prompt_logprobs is not None:  # supports_prompt_logprobs is False: the scheduler refuses first
            raise ValueError("prompt logprobs are not available on the CUDA backend")
        st, s = self.pstage, self.stream
        v, p = st.view, st.ptr
        self._stage_span(span, 0, 0)
        self._upload_rows(n, len(span.block_table))
        per_row = 3 if self.mrope else 1  # multimodal rope: (t, h, w) a row
        images = self._image_rows(span)
        for c0 in range(0, n, PREFILL_CHUNK):
            rows = min(PREFILL_CHUNK, n - c0)
            embeds = [(lo - c0, r) for lo, r in _clip_rows(images, c0, c0 + rows)]
            self.forward.prefill_rows(rows, p["tokens"] + 4 * c0, p["positions"] + 4 * per_row * c0,
                                      p["slots"] + 4 * c0, [(0, rows, p["block_table"], start + c0)],
                                      embeds=embeds)  # fmt: skip
        req = span.sample
        if req is None and not span.want_logits:
            self.queued_at = time.perf_counter()
            s.synchronize()
            return
        self.forward.head(1, rows - 1)
        logits = self.ws.logits
        if span.want_logits:  # raw logits, queued before the penalties touch them
            cuda.memcpy_dtoh_async(self.logits_host[0], logits, s)
        if req is not None:
            if sampling.stage_row(st, 0, req, start + n, self.config.vocab_size, self.pen_stride):
                st.upload(s, "pen_tokens", "pen_counts")
            st.upload(s, "sample_pos", "out")
            sampling.sample_on_device(self.kern, s, logits, self.config.vocab_size, st, self.pen_stride, 1)
            cuda.memcpy_dtoh_async(v["out"], p["out"], s)
            if sampling.needs_logits(req):
                cuda.memcpy_dtoh_async(self.logits_host[1], logits, s)
        self.queued_at = time.perf_counter()
        s.synchronize()
        if span.want_logits:
            out.prefill_logits = self.logits_host[0].copy()
        if req is not None:
            out.prefill_token, out.prefill_logprob = sampling.finish_row(self.logits_host[1], req, int(v["out"][0]),
                                                                         start + n)  # fmt: skip

    def _prefill_pass(self, spans: Sequence[PrefillSpan], outs: Sequence[StepOutput], layout: list) -> None:
        """The spans of ``layout`` (``prefill_rows.SpanRows``) as one pass of the forward; then each
        sampled span's last row through the head (in slices the GEMV takes, as its ``prefill`` takes
        its one row) and one sampling call over those rows; one read-back, one synchronization."""
        import pycuda.driver as cuda

        from engine.backends.cuda.prefill_rows import head_slices
        from engine.cu.kernels import gemv_rows

        st, s, ws = self.pstage, self.stream, self.ws
        v, p = st.view, st.ptr
        for r in layout:
            self._stage_span(spans[r.index], r.row0, r.table0)
        end = layout[-1]
        self._upload_rows(end.row0 + end.rows, end.table0 + len(spans[end.index].block_table))
        table = 0
        if len(layout) > 1 and self.tuning.attention_spans:  # the spans on the device: one attention launch a layer
            t0 = layout[0].table0
            v["span_table"][: 4 * len(layout)] = [x for r in layout for x in (r.row0, r.rows, r.start, r.table0 - t0)]
            st.upload(s, "span_table", nbytes=16 * len(layout))
            table = p["span_table"]
        self.forward.prefill_rows(end.row0 + end.rows, p["tokens"], p["positions"], p["slots"],
                                  [(r.row0, r.rows, p["block_table"] + 4 * r.table0, r.start) for r in layout],
                                  span_table=table)  # fmt: skip
        sampled = [r for r in layout if spans[r.index].sample is not None]
        if not sampled:
            self.queued_at = time.perf_counter()
            s.synchronize()
            return
        hid, vocab, m = self.config.hidden_size, self.config.vocab_size, len(sampled)
        for j, r in enumerate(sampled):  # last rows to the front of ws.x, in order: row j <= r.last is no later source
            if r.last != j:
                cuda.memcpy_dtod_async(ws.x + 4 * hid * j, ws.x + 4 * hid * r.last, 4 * hid, s)
        for r0, rows in head_slices(m, min(gemv_rows(self.weights.lm_head), self.kern.gemv_cap)):
            self.forward.head(rows, r0, out_row=r0)
        for j, r in enumerate(sampled):  # no penalty lists: layout leaves spans with penalties alone
            sampling.stage_row(st, j, spans[r.index].sample, r.start + r.rows, vocab, self.pen_stride)
        st.upload(s, "sample_pos", "out")
        sampling.sample_on_device(self.kern, s, ws.logits, vocab, st, self.pen_stride, m)
        cuda.memcpy_dtoh_async(v["out"], p["out"], s)
        if any(sampling.needs_logits(spans[r.index].sample) for r in sampled):
            cuda.memcpy_dtoh_async(self.logits_host[:m], ws.logits, s)
        self.queued_at = time.perf_counter()
        s.synchronize()
        for j, r in enumerate(sampled):
            out = outs[r.index]
            out.prefill_token, out.prefill_logprob = sampling.finish_row(self.logits_host[j], spans[r.index].sample,
                                                                         int(v["out"][j]), r.start + r.rows)  # fmt: skip

    def _stage_span(self, span: PrefillSpan, row0: int, table0: int) -> None:
        """Write ``span``'s tokens, rope positions and KV slots at rows ``row0..`` of the prefill staging's
        host side, its block table at entry ``table0`` (the caller uploads: ``_upload_rows``)."""
        n, start = len(span.token_ids), span.start_pos
        if len(span.block_table) > self.bt_stride:
            raise ValueError(f"block table longer than max_context ({self.bt_stride} blocks)")
        positions = np.arange(start, start + n, dtype=np.int64)
        slots = self._slots(span.block_table, positions)
        v = self.pstage.view
        v["tokens"][row0 : row0 + n] = np.asarray(span.token_ids, dtype=np.int32)
        if self.mrope:  # multimodal rope: (t, h, w) a row
            three = positions if span.rope_positions is None else span.rope_positions
            v["positions"][3 * row0 : 3 * (row0 + n)] = np.broadcast_to(three, (3, n)).T.reshape(-1)
        else:
            v["positions"][row0 : row0 + n] = positions
        v["slots"][row0 : row0 + n] = slots
        v["block_table"][table0 : table0 + len(span.block_table)] = np.asarray(span.block_table, dtype=np.int32)

    def _upload_rows(self, rows: int, tables: int) -> None:
        """Copy the first ``rows`` rows and ``tables`` block-table entries of the prefill staging up."""
        st, s = self.pstage, self.stream
        st.upload(s, "block_table", nbytes=4 * tables)
        for name in ("tokens", "positions", "slots"):
            st.upload(s, name, nbytes=4 * rows * (3 if name == "positions" and self.mrope else 1))

    def _image_rows(self, span: PrefillSpan) -> list[tuple[int, np.ndarray]]:
        """(span row, float32 rows) of every image the span reaches, encoding an image the first time."""
        if not span.images:
            return []
        if self.vision is None:
            raise ValueError("a prefill span with images on a model without a vision tower")
        out, start, end = [], span.start_pos, span.start_pos + len(span.token_ids)
        for img in span.images:
            if img.embeds is None:
                img.embeds = self.vision.encode(self.stream, img.pixel_values, img.grid_thw)
            lo, hi = max(img.offset, start), min(img.end, end)
            if lo < hi:
                out.append((lo - start, img.embeds[lo - img.offset : hi - img.offset]))
        return out

    def _slots(self, block_table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        bt = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if len(positions) and (idx.max() >= len(bt) or positions.max() >= self.max_context):
            raise ValueError(f"block table of {len(bt)} blocks does not reach position {int(positions.max())}")
        return bt[idx] * self.block_size + positions % self.block_size

    def step(self, plan: StepPlan, *, defer: bool = False) -> StepOutput:
        """Backend.step; ``defer``: a decode round whose rows need nothing on the host (one group of
        rows, no logits read back) returns once queued, with ``out.unfinished`` set (``finish``)."""
        self._defer = defer
        # The device tokens a round planned ahead feeds, forgotten at once (as Backend.step forgets
        # last_tokens): should this step raise, the one queued behind raises before it replays.
        self._rows_before, self._feed_from = {}, self._rows_before
        try:
            return super().step(plan)
        finally:
            self._defer = False  # a decode_round called on its own (benchmarks, tests) completes in the call

    def fill_pending(self, lanes: Sequence[DecodeLane], last: dict[int, int]) -> None:
        """PENDING rows: from ``last`` where the round before ended on the host, else from its row's
        token on the device (``_feed``: row -> the row of the round before)."""
        self._feed = {}
        for i, ln in enumerate(lanes):
            if ln.token_id == PENDING:
                if ln.seq_id in last:
                    ln.token_id = last[ln.seq_id]
                else:
                    self._feed[i] = self._feed_from[ln.seq_id]  # KeyError: the round before raised

    def finish(self, out: StepOutput) -> StepOutput:
        """Wait for a deferred round's tokens (``step(defer=True)``) and fill them into ``out``."""
        if out.unfinished is not None:
            from engine.cu import runtime

            with runtime.current():
                self._land(out.unfinished)
        return out

    def decode_round(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        from engine.cu import runtime

        with runtime.current():
            w = self.max_round_rows
            if len(lanes) > w and self._feed:
                raise ValueError("a round planned ahead wider than one graph")  # plan_ahead never makes one
            defer = self._defer and len(lanes) <= w
            for g in range(0, len(lanes), w):
                self._decode_group(lanes[g : g + w], out, defer)

    def _decode_group(self, lanes: Sequence[DecodeLane], out: StepOutput, defer: bool = False) -> None:
        import pycuda.driver as cuda

        st, s, M = self.dstage, self.stream, len(lanes)
        prev = self._in_flight.pop((st.set + 1) % 2, None)
        if prev is not None:  # its tokens are in the host set this round is about to write
            self._land(prev)
        st.flip()
        v, stride, bs, vocab = st.view, self.bt_stride, self.block_size, self.config.vocab_size
        any_pen = False
        tokens, positions, slots, src, feed = v["tokens"], v["positions"], v["slots"], v["src"], self._feed
        lane_first, first, seq = v["lane_first"], 0, None
        for i, ln in enumerate(lanes):  # plain Python per lane: this is on every round's critical path
            if ln.seq_id != seq:  # a lane's rows are consecutive (its verify rows after its first)
                first, seq = i, ln.seq_id
            lane_first[i] = first
            bt, pos = ln.block_table, int(ln.position)
            nb = len(bt)
            if nb > stride:
                raise ValueError(f"block table longer than max_context ({stride} blocks)")
            if not 0 <= pos < self.max_context or pos // bs >= nb:
                raise ValueError(f"block table of {nb} blocks does not reach position {pos}")
            if ln.token_id == PENDING:
                tokens[i], src[i] = 0, feed[i]
            else:
                tokens[i], src[i] = ln.token_id, -1
            positions[i] = pos
            if self.mrope:
                v["rope_positions"][i] = pos + ln.rope_delta
            slots[i] = int(bt[pos // bs]) * bs + pos % bs
            v["block_tables"][i * stride : i * stride + nb] = bt
            any_pen |= sampling.stage_row(st, i, ln.sample, pos + 1, vocab, self.pen_stride)
        want = any(sampling.needs_logits(ln.sample) for ln in lanes)
        r = _Round(lanes, out, st.set, v["out"]) if defer and not want else None
        if r is not None:
            r.start.record(s)
        st.upload(s, "tokens", "pen_num")
        st.upload(s, "block_tables", nbytes=4 * M * stride)
        if self.mrope:
            st.upload(s, "rope_positions")
        if any_pen:
            st.upload(s, "pen_tokens", nbytes=4 * M * self.pen_stride)
            st.upload(s, "pen_counts", nbytes=4 * M * self.pen_stride)
        self.graphs.replay(M)
        cuda.memcpy_dtoh_async(v["out"], st.ptr["out"], s)
        if want:
            cuda.memcpy_dtoh_async(self.logits_host[:M], self.ws.logits, s)
        st.mark(s)
        self._rows_before = {ln.seq_id: i for i, ln in enumerate(lanes)}  # (one group: see decode_round)
        if r is not None:
            r.end.record(s)
            out.unfinished = self._in_flight[st.set] = r
            return
        s.synchronize()
        for i, ln in enumerate(lanes):
            token, lp = sampling.finish_row(self.logits_host[i], ln.sample, int(v["out"][i]), int(ln.position) + 1)
            out.decode_tokens.append(token)
            out.decode_logprobs.append(lp)

    def _land(self, r: _Round) -> None:
        """A deferred round's tokens into its output, once its copies are done (at most once)."""
        if r.out.unfinished is not r:
            return
        r.end.synchronize()
        r.out.decode_tokens.extend(int(t) for t in r.tokens[: len(r.lanes)])
        r.out.decode_logprobs.extend([None] * len(r.lanes))
        r.out.decode_seconds = r.end.time_since(r.start) / 1e3
        r.out.unfinished = None
        if self._in_flight.get(r.set) is r:
            del self._in_flight[r.set]

    # --- KV pages --------------------------------------------------------------------------

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        from engine.cu import runtime

        with runtime.current():
            self.kv.swap_out(pairs, self.stream)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        from engine.cu import runtime

        with runtime.current():
            self.kv.swap_in(pairs, self.stream)

    def unload(self) -> None:
        if not self.mem and self.graphs is None:
            return
        from engine.cu import runtime

        with runtime.current():
            self.stream.synchronize()
            if self.graphs is not None:
                self.graphs.destroy()
            self.graphs = None
            for st in (self.dstage, self.pstage):
                if st is not None:
                    st.free()
            self.dstage = self.pstage = None
            self._in_flight, self._rows_before = {}, {}
            if self.mem:
                self.mem.free()
            self.mem = None
            self.kv = self.logits_host = self.vision = None
            self.plan = None


class _Round:
    """A decode round queued with ``step(defer=True)``: its lanes, output, staging set and the
    events around it on the stream (``end``: its tokens are in ``tokens``, the set's host ``out``)."""

    def __init__(self, lanes, out: StepOutput, set_: int, tokens: np.ndarray) -> None:
        import pycuda.driver as cuda

        self.lanes, self.out, self.set, self.tokens = lanes, out, set_, tokens
        self.start, self.end = cuda.Event(), cuda.Event()


def _clip_rows(runs: list[tuple[int, np.ndarray]], lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """The parts of (first row, rows) ``runs`` that fall in rows ``lo..hi`` (first rows kept absolute)."""
    out = []
    for row, rows in runs:
        a, b = max(row, lo), min(row + len(rows), hi)
        if a < b:
            out.append((a, rows[a - row : b - row]))
    return out
