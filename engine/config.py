"""The engine's part of the configuration (``model.*`` and ``spec.*`` keys).

The Django side owns the full schema and where values come from (flags,
environment, admin, PATCH /v1/config); the engine only sees this dataclass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MiB = 1 << 20


@dataclass
class CudaTuning:
    """The CUDA backend's tuning knobs (``cuda.*`` keys); engine/ reads no environment."""

    gemv_u2_below: int = 40 << 20  # cuda.gemv_u2_below: matrices under this many weights use gemv_tc's 2-step variant
    kernel_cache_dir: str = ""  # compiled kernels (PyCUDA's cache); "" = <models dir>/.cache/pycuda
    expert_budget: int = 0  # cuda.expert_budget: device bytes for MoE experts (0 = all resident); beyond: cache
    # model.gpu_budget (carried here: the backend's own knob): what a load may take of the card,
    # <= 1 a fraction of its free memory at load, > 1 bytes (engine/backends/cuda/kv.py kv_budget).
    gpu_budget: float = 0.9
    # cuda.round_rows: rows a decode round may hold (lanes and their verify rows; the kernels and
    # graphs take 64). Past 16 a round costs more than 1.3x the plain one on the H200 (docs/SPECULATION.md).
    round_rows: int = 16
    # cuda.known_rows: rows a decode round may hold when the rows past cuda.round_rows are known tokens
    # (short prompts' tails fed as rows, forced tokens after a take-back), not drafts; 0 = round_rows.
    # A burst of short prompts then starts in one wider round instead of several (the graphs of every
    # width up to it are captured at load; prefill passes keep round_rows' GEMV cap). The server's
    # default is 64 (ignis_site/config.py, since 2026-12-07: docs/PERFORMANCE.md, "Where a burst's
    # first tokens wait"); a backend built directly (the card tests, the benches) keeps 0, so their
    # graphs stay as they pin them.
    known_rows: int = 0
    # cuda.pdl: launch a decode round's kernels with programmatic dependent launch (each may start
    # while the one before ends; gemv.cu issues its first weight loads before it waits). docs/CUDA.md.
    pdl: bool = False
    # cuda.pinned_upload: bf16 weights go up at load through pinned, double-buffered staging written in
    # their device layout by a thread pool (engine/backends/cuda/pinned.py); False: a synchronous copy a
    # tensor. On the H200 2.8x faster than off for the 8B checkpoint (docs/PERFORMANCE.md, "Cold load").
    pinned_upload: bool = True
    # A bf16 GEMV of 9..64 rows (wide rounds) on a matrix of at least this many rows runs gemv_wide.cu
    # (gemv_tc's bits, x read from L2 once a block of 128 weight rows); 0: gemv_tc's own wide variants.
    gemv_wide_min_n: int = 0
    # cuda.quant_activations: a decode GEMV over GGUF blocks quantizes x to int8 (a scale per 32 values,
    # quant_act.cu) and multiplies with integer mma (gemv_q.cu's QACT8). Off until the card says it is
    # right and faster (docs/QUANT.md, "Int8 activations").
    quant_activations: bool = False
    # The quantized GEMVs launch the blocks resident at once, each walking 16-row tiles (gemv_q.cu):
    # the stage pipeline runs on from one tile into the next instead of starting over a block a tile.
    quant_persist: bool = False
    # A bf16 GEMV of 33..64 rows (engine/cu/kernels.py PAIR_FROM) runs gemv_pair.cu's variant (a block
    # of two 16-row tiles whose warps share each batch of x through shared memory, so x leaves L2 once
    # per 32 weight rows; gemv_tc's bits): rounds of 36..64 rows 6-9% faster on an H100 (docs/CUDA.md,
    # "Paired wide variants").
    gemv_pair: bool = True
    # Decode attention of a wide round (9 rows up) runs attention_decode.cu's DECODE_LR build: a lane's
    # verify rows share a block and read their keys once (the same bits). Right on the card, and
    # slower: every verify round 5-13% slower with it on an H100 (docs/CUDA.md, "A lane's rows in one
    # attention block"), so off.
    decode_lanes: bool = False
    # cuda.fp8_gemm: prefill of an FP8 / FP8B matrix on Hopper's fp8 tensor cores (x quantized to e4m3
    # a row, or a row and 128-wide block; gemm_hopper.cu's HG_FP8 builds) instead of dequantizing the
    # weights to bf16 for the bf16 GEMM. 1.7-2.3x faster fp8 prefill on an H100, 2.6% rms on each GEMM
    # output: off until a real checkpoint's quality is measured (docs/QUANT.md, "FP8 prefill on the
    # tensor cores").
    fp8_gemm: bool = False
    # cuda.narrow_tiles: a prefill GEMM of 33..128 rows may run gemm_hopper's 64 / 32-column tiles
    # (engine/cu/hopper.py NARROW, pick), so W streams from 96-128 SMs instead of 32-48 on the
    # 4,096-column products (the same bits; docs/CUDA.md, "The Hopper prefill GEMM"): 2-24% faster
    # products at 48 and 120 rows on an H100.
    narrow_tiles: bool = True
    # cuda.attention_spans: a prefill pass of several spans runs each layer's attention as one launch
    # for all of them (attention_prefill_hopper.cu's prefill_attn_hopper_spans, the same bits as one a
    # span; docs/CUDA.md, "Prompts prefilled together"): 6 spans 417 -> 257 launches a pass. Off until its card
    # tests (tests/kernels/test_cuda_attention_hopper.py, test_cuda_prefill_group.py) have run on a card.
    attention_spans: bool = False


@dataclass
class EngineConfig:
    backend: str = "numpy"  # numpy | cpu | cuda
    decode_lanes: int = 8  # spec.decode_lanes
    prefill_chunk: int = 1024  # model.prefill_chunk
    # model.short_prefill: a prompt whose uncached tail is at most this many tokens is fed as rows of
    # the decode round instead of a prefill pass (0 = never); engine/scheduler.py _admit_short.
    short_prefill: int = 16
    decode_share: float = 0.25  # model.decode_share (fraction of time the lanes keep)
    # model.prefill_group: prompts that fit whole in one chunk together prefill in one step
    # (engine/prefill_group.py); False: one prompt a step.
    prefill_group: bool = True
    # model.async_rounds: plan a decode round while the one before computes (engine/run_ahead.py)
    # on a backend that can (Backend.supports_async_rounds); False: every round after the last one's output.
    async_rounds: bool = True
    default_max_tokens: int = 1024  # model.default_max_tokens
    max_context: int = 8192  # model.max_context (clamped to the model's own)
    block_size: int = 16  # model.kv_block_size
    weight_format: str = "auto"  # model.weight_format: auto (as stored) | bf16 | fp8 (engine/loaders/fp8.py)
    kv_ram_budget: int = 768 * MiB  # numpy backend: RAM for the device-tier KV pool
    host_kv_budget: int = 2048 * MiB  # the host-RAM tier for swapped pages
    retry_after_floor: float = 1.0  # seconds; the least Retry-After an engine_full gets
    blas_threads: int = 1  # model.blas_threads: numpy backend's BLAS threads (0 = leave BLAS as it is)
    spec_enabled: bool = True  # spec.enabled: speculative rounds (prompt lookup, Predicted Outputs)
    spec_max_draft: int = 8  # spec.max_draft: drafts a lane proposes at most in one round
    spec_cost_aware: bool = False  # spec.cost_aware: keep only the drafts worth their rows' time (spec/cost.py)
    spec_ngram: int = 4  # spec.ngram: longest n-gram prompt lookup matches (down to 2)
    # The reasoning loop guard (engine/spec/loop_guard.py, spec.loop_guard*): read at admission.
    loop_guard: bool = True  # spec.loop_guard
    loop_guard_min_span: int = 8  # spec.loop_guard_min_span: shortest repeating span that counts
    loop_guard_max_span: int = 256  # spec.loop_guard_max_span: longest span watched
    loop_guard_count: int = 3  # spec.loop_guard_count: back-to-back occurrences that fire it
    spec_draft_model: str = ""  # spec.draft_model: a draft model's artifact path ("" = none)
    spec_draft_kv: int = 256 * MiB  # spec.draft_kv: bytes of the draft model's KV pool
    cpu_threads: int = 0  # model.cpu_threads: cpu backend's threads (0 = every core this process may use)
    cpu_kernel_cache_dir: str = ""  # cpu backend's compiled kernels; "" = <repo>/models/.cache/cpu-kernels
    cuda: CudaTuning = field(default_factory=CudaTuning)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if isinstance(values.get("cuda"), dict):
            values["cuda"] = CudaTuning(**values["cuda"])
        return cls(**values)
