"""One model load, on the step thread: weights in, memory planned, backend and scheduler built.

The model host (engine/host.py) decides when to load and what a failure
means; this module only does the work. The loader and the backend factory
are parameters so tests load the fake backend.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Collection
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np

from engine import gc_pause
from engine.backend import Backend
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.scheduler import Scheduler
from engine.switching import planned_ram

log = logging.getLogger("ignis.engine")

# (path, progress(done, total)) -> the model's shape and float32 weights in HF naming.
Loader = Callable[[Path, Callable[[int, int], None]], tuple[ModelConfig, dict[str, np.ndarray]]]
# (backend name, the engine config whose knobs it takes) -> an unloaded backend.
BackendFactory = Callable[[str, EngineConfig], Backend]


def load_artifact(path: Path, progress: Callable[[int, int], None], *, as_stored: bool | Collection[str] = False,
                  **options) -> tuple[ModelConfig, dict[str, np.ndarray]]:  # fmt: skip
    """The default loader: engine.loaders.load_artifact (imported when first needed); ``options``:
    ``loader_options``' (fp8, bf16 and MXFP4 tensors as stored, model.weight_format)."""
    from engine.loaders import load_artifact as load

    return load(path, progress, as_stored=as_stored, **options)


def create_backend(name: str, cfg: EngineConfig) -> Backend:
    """The default backend factory: engine.backends.create_backend."""
    from engine.backends import create_backend as create

    return create(name, cfg)


def loader_options(cfg: EngineConfig, backend: Backend) -> dict:
    """The loader's arguments for ``backend``: fp8 ones (none where it takes no fp8 weights, so FP8
    checkpoints come as float32; ``model.weight_format = fp8`` there is refused, ValueError),
    ``bf16_as_stored`` where it takes bf16 tensors as stored, and ``mxfp4_as_stored`` (with
    ``weight_format``: ``bf16`` dequantizes) where it takes MXFP4 ones (``takes_mxfp4``)."""
    from engine.loaders.hf import check_weight_format

    takes_fp8 = getattr(backend, "takes_fp8", False)
    try:
        check_weight_format(cfg.weight_format, takes_fp8)
    except ValueError:
        if cfg.weight_format == "fp8":
            raise ValueError(
                f"model.weight_format 'fp8': the {backend.name} backend does not take fp8 weights (use auto or bf16)"
            ) from None
        raise
    kw = {"fp8_as_stored": True, "weight_format": cfg.weight_format} if takes_fp8 else {}
    if getattr(backend, "takes_bf16", False):  # bf16 tensors stay bf16 (engine.loaders.bf16): no float32 copy
        kw["bf16_as_stored"] = True
    if getattr(backend, "takes_mxfp4", False):  # MXFP4 experts stay 4.25 bits a weight (engine.loaders.mxfp4)
        kw.update(mxfp4_as_stored=True, weight_format=cfg.weight_format)
    return kw


def load_draft(cfg: EngineConfig, target: ModelConfig, loader: Loader, backend_factory: BackendFactory):
    """``spec.draft_model`` on a backend of the target's kind with a ``spec.draft_kv`` pool; refused
    (ValueError naming the key) unless it shares the target's vocabulary."""
    from engine.spec.draft_model import DraftModel

    draft_cfg, weights = loader(Path(cfg.spec_draft_model), lambda done, total: None)
    if draft_cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"spec.draft_model: a vocabulary of {draft_cfg.vocab_size} tokens, the model's has "
            f"{target.vocab_size} (a draft model needs the model's tokenizer)"
        )
    backend = backend_factory(cfg.backend, cfg)
    kw = dict(block_size=cfg.block_size, kv_budget_bytes=cfg.spec_draft_kv, host_kv_budget_bytes=0,
              max_context=cfg.max_context)  # fmt: skip
    try:
        plan = backend.load(draft_cfg, weights, **kw)
    except NotImplementedError:
        if backend.name != "cpu":
            raise
        backend = backend_factory("numpy", cfg)  # an architecture the cpu backend does not run
        plan = backend.load(draft_cfg, weights, **kw)
    log.info("ignis.spec.draft_model", extra={"path": cfg.spec_draft_model, "weights_bytes": plan.weights_bytes,
                                              "kv_blocks": plan.num_blocks})  # fmt: skip
    return DraftModel(backend, plan.num_blocks, plan.block_size, cfg.prefill_chunk)


@contextmanager
def frozen_heap():
    """The objects alive at entry sit out the garbage collector's full collections until exit.

    A load allocates hundreds of thousands of small objects (a GGUF's metadata: two numpy views
    per vocabulary string), and each full collection that triggers walks the whole heap holding
    the GIL: in a server's process (Django, the channel layer) 0.1-0.3 s a time, ten times in a
    135M GGUF load, while the engine loop (its heartbeat) waits. Frozen (``gc.freeze``), the heap
    the load started with is not walked; ``gc.unfreeze`` hands it back to the oldest generation.
    Where something else froze objects first, the heap is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@frozen_heap()
def load_model(
    cfg: EngineConfig,
    path: Path,
    *,
    served_id: str,
    max_context: int,
    ram_budget: int,
    progress: Callable[[int, int], None],
    on_context: Callable[[int], None],
    loader: Loader = load_artifact,
    backend_factory: BackendFactory = create_backend,
) -> tuple[Backend, Scheduler]:
    """Load ``path`` under ``cfg``; returns the loaded backend and a scheduler over its pool.

    ``max_context`` is the one asked for: clamped to the model's own, it is set on
    ``cfg`` and reported through ``on_context`` as soon as the model's shape is known
    (before the weights are planned, so a status read after a failed load shows it).
    On the numpy and cpu backends the RAM plan (engine/memory.py) sizes the KV pool and
    refuses, with SwitchRefused, a plan that does not fit.
    """
    from engine.constraint import ConstraintFactory
    from engine.kv_manager import KVManager, release_window

    t0 = time.perf_counter()
    # The backend first: the cpu backend compiles its kernels here (or the factory falls
    # back to numpy), and names the GGUF block types it keeps as stored (``weights_as_stored``).
    backend = backend_factory(cfg.backend, cfg)
    kw = loader_options(cfg, backend)
    stored = getattr(backend, "weights_as_stored", False)
    if stored and cfg.weight_format == "bf16" and backend.name == "cuda":
        stored = False  # model.weight_format bf16: GGUF blocks dequantized to bf16 at load, as before
    if stored:
        model_cfg, weights = loader(path, progress, as_stored=stored, **kw)
    else:
        model_cfg, weights = loader(path, progress, **kw)
    cfg.max_context = min(max_context, model_cfg.max_position)
    on_context(cfg.max_context)
    kv_budget = None
    if cfg.backend in ("numpy", "cpu"):
        # Weights, then working memory; the KV pool takes the rest of the RAM budget.
        kv_budget = planned_ram(
            model_cfg,
            ram_budget=ram_budget,
            kv_ram_budget=cfg.kv_ram_budget,
            max_context=cfg.max_context,
            block_size=cfg.block_size,
            freed_bytes=0,
        ).kv_bytes
    # The draft model first: on a card, the target's KV pool then takes what is left.
    draft = load_draft(cfg, model_cfg, loader, backend_factory) if cfg.spec_draft_model else None
    try:
        try:
            plan = backend.load(model_cfg, weights, block_size=cfg.block_size, kv_budget_bytes=kv_budget,
                                host_kv_budget_bytes=cfg.host_kv_budget, max_context=cfg.max_context)  # fmt: skip
        except NotImplementedError as exc:
            if backend.name != "cpu":
                raise
            # The cpu backend runs the llama family; the numpy backend (the reference) runs every
            # architecture: it takes the model, with float32 weights.
            log.info("ignis.backend.fallback", extra={"backend": "numpy", "model": served_id, "reason": str(exc)})
            del weights
            backend = backend_factory("numpy", cfg)
            _, weights = loader(path, progress)
            plan = backend.load(model_cfg, weights, block_size=cfg.block_size, kv_budget_bytes=kv_budget,
                                host_kv_budget_bytes=cfg.host_kv_budget, max_context=cfg.max_context)  # fmt: skip
    except BaseException:
        if draft is not None:
            draft.backend.unload()
        raise
    del weights
    try:
        constraints = ConstraintFactory(path)
        scheduler = Scheduler(
            cfg,
            KVManager(plan.num_blocks, plan.block_size, plan.num_host_blocks),
            constraints=constraints,
            supports_prompt_logprobs=backend.supports_prompt_logprobs,
            kv_window=release_window(model_cfg, backend.releases_window_pages),
            max_round_rows=backend.max_round_rows,
            max_draft_rows=backend.max_draft_rows,
            groups_prefill=backend.prefills_together,
            draft_model=draft,
            vision=model_cfg.vision,
        )
    except BaseException:
        backend.unload()
        if draft is not None:
            draft.backend.unload()
        raise
    constraints.warm_in_background()
    log.info("ignis.runtime.vram_plan", extra={"model": served_id, "backend": cfg.backend, **asdict(plan)})
    seconds = round(time.perf_counter() - t0, 2)
    log.info("ignis.model.loaded", extra={"model": served_id, "seconds": seconds, "path": str(path)})
    gc_pause.after_load()
    return backend, scheduler
