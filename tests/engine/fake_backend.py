"""A backend without a model, vLLM-style factories for scheduler tests, and
FakeModels: the loader and backend factory a ModelHost takes, for worker tests.

The fake keeps real KV books: every written position's token lands in the
slot its block table names, and the next token is a hash of the context it
reads back from those slots. A wrong block table, a lost swap or a prefix
claimed from the wrong block therefore changes the output, while a correct
schedule reproduces an undisturbed run token for token.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from engine.backend import Backend, DecodeLane, PrefillSpan, StepOutput, StepPlan
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.loaders.hf import config_from_hf
from engine.memory import MemoryPlan
from engine.messages import AddRequest, RequestFinished, TokenEvent
from engine.model_config import ModelConfig
from engine.outputs import EngineOutput
from engine.scheduler import Scheduler

VOCAB = 997


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeBackend(Backend):
    name = "fake"
    prefills_together = True  # the scheduler groups prefills (engine/prefill_group.py) for this backend
    supports_async_rounds = True  # the worker plans rounds ahead (engine/run_ahead.py) unless cfg says not

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        *,
        prefill_seconds: float = 0.0,
        decode_seconds: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        self.prefill_seconds = prefill_seconds  # per prefilled token
        self.decode_seconds = decode_seconds  # per round
        self.plans: list[StepPlan] = []
        self.before_step: Callable[[StepPlan], None] | None = None  # FakeModels: hold or raise
        # defers_rounds (set True by a test): step(defer=True) hands a decode round back "queued", its
        # tokens held until finish(out), as a GPU backend's would be; ``calls`` logs ("step" | "finish", n).
        self.calls: list[tuple[str, int]] = []
        self.unloaded = threading.Event()

    @staticmethod
    def next_token(context: Sequence[int]) -> int:
        h = 0
        for t in context:
            h = (h * 1_000_003 + t + 1) % 2_147_483_647
        return h % VOCAB

    def _write(self, table: Sequence[int], pos: int, token: int) -> None:
        self.device[table[pos // self.block_size]][pos % self.block_size] = token

    def _read(self, table: Sequence[int], n: int) -> list[int]:
        ctx = [self.device[table[p // self.block_size]][p % self.block_size] for p in range(n)]
        assert None not in ctx, "read a slot nobody wrote"
        return ctx

    def load(self, config, weights, *, block_size, kv_budget_bytes, host_kv_budget_bytes, max_context) -> MemoryPlan:
        self.config, self.block_size = config, block_size
        self.device = [[None] * block_size for _ in self.device]
        self.host = [[None] * block_size for _ in self.host]
        n, n_host = len(self.device), len(self.host)
        self.plan = MemoryPlan(  # one "byte" a block
            budget_bytes=n + n_host, weights_bytes=0, workspace_bytes=0, kv_bytes=n, block_size=block_size,
            num_blocks=n, host_kv_bytes=n_host, num_host_blocks=n_host,
        )  # fmt: skip
        return self.plan

    def prefill(self, span: PrefillSpan, out: StepOutput) -> None:
        for i, t in enumerate(span.token_ids):
            self._write(span.block_table, span.start_pos + i, t)
        end = span.start_pos + len(span.token_ids)
        if span.sample is not None:
            out.prefill_token = self.next_token(self._read(span.block_table, end))
        if span.want_logits:
            out.prefill_logits = np.arange(4, dtype=np.float32) + end

    def decode_round(self, lanes: Sequence[DecodeLane], out: StepOutput) -> None:
        for lane in lanes:
            self._write(lane.block_table, lane.position, lane.token_id)
            out.decode_tokens.append(self.next_token(self._read(lane.block_table, lane.position + 1)))
            out.decode_logprobs.append(None)

    def swap_out(self, pairs) -> None:
        for d, h in pairs:
            self.host[h] = list(self.device[d])

    def swap_in(self, pairs) -> None:
        for h, d in pairs:
            self.device[d] = list(self.host[h])
            self.host[h] = [None] * self.block_size

    def unload(self) -> None:
        self.plan = None
        self.unloaded.set()

    def step(self, plan: StepPlan, *, defer: bool = False) -> StepOutput:
        if self.before_step is not None:
            self.before_step(plan)
        self.plans.append(plan)
        out = super().step(plan)
        out.prefill_seconds = self.prefill_seconds * sum(len(span.token_ids) for span in plan.prefills)
        out.decode_seconds = self.decode_seconds if plan.decode else 0.0
        n = len(self.plans)
        self.calls.append(("step", n))
        if defer and self.defers_rounds and out.decode_tokens:
            out.unfinished = (n, out.decode_tokens, out.decode_logprobs)
            out.decode_tokens, out.decode_logprobs = [], []
        return out

    def finish(self, out: StepOutput) -> StepOutput:
        if out.unfinished is not None:
            n, out.decode_tokens, out.decode_logprobs = out.unfinished
            out.unfinished = None
            self.calls.append(("finish", n))
        return out


class Gate:
    """Open: everyone passes. Closed: whoever arrives waits there until it opens, and
    ``held`` says one does (loads and steps run on the worker's step thread; a test
    waits on ``held`` with asyncio.to_thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self.held = threading.Event()

    def close(self) -> None:
        with self._cond:
            self._open = False
            self.held.clear()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def enter(self) -> None:
        with self._cond:
            if not self._open:
                self.held.set()
                self._cond.wait_for(lambda: self._open)


class FakeModels:
    """Model directories the fake loader reads (config.json only) and the backends it
    makes, with what a worker test controls: a load that waits or fails, a step
    that waits or raises."""

    def __init__(self, root: Path, *, num_blocks: int = 64, block_size: int = 4, num_host_blocks: int = 16) -> None:
        self.root = root
        self.sizes = (num_blocks, block_size, num_host_blocks)
        self.failing: set[Path] = set()  # loads of these paths raise
        self.loads: list[Path] = []  # every load started, in order
        self.backends: list[FakeBackend] = []  # every backend made, in order
        self.load_gate, self.step_gate = Gate(), Gate()
        self.fail_step: Callable[[StepPlan], bool] | None = None  # True: this step raises (every time)

    def model(self, name: str, max_position: int = 256) -> Path:
        """A directory the precheck accepts (artifact_config reads its config.json)."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": max_position,
        }
        (path / "config.json").write_text(json.dumps(config))
        return path

    def load(self, path: Path, progress: Callable[[int, int], None]) -> tuple[ModelConfig, dict]:
        """The loader (engine.loaders.load_artifact's signature)."""
        self.loads.append(Path(path))
        progress(0, 1)
        self.load_gate.enter()
        if Path(path) in self.failing:
            raise RuntimeError(f"cannot load {Path(path).name}")
        progress(1, 1)
        return config_from_hf(json.loads((Path(path) / "config.json").read_text())), {}

    def create_backend(self, name: str, config: EngineConfig | None = None) -> FakeBackend:
        """The backend factory (engine.backends.create_backend's signature)."""
        backend = FakeBackend(*self.sizes)
        backend.before_step = self._before_step
        self.backends.append(backend)
        return backend

    def _before_step(self, plan: StepPlan) -> None:
        self.step_gate.enter()
        if self.fail_step is not None and self.fail_step(plan):
            raise RuntimeError("the fake step failed")


def create_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    num_host_blocks: int = 64,
    decode_lanes: int = 4,
    prefill_chunk: int = 16,
    decode_share: float = 0.25,
    max_context: int = 256,
    default_max_tokens: int = 16,
    prefill_seconds: float = 0.0,
    decode_seconds: float = 0.0,
) -> tuple[Scheduler, FakeBackend, FakeClock]:
    cfg = EngineConfig(
        decode_lanes=decode_lanes,
        prefill_chunk=prefill_chunk,
        decode_share=decode_share,
        max_context=max_context,
        block_size=block_size,
        default_max_tokens=default_max_tokens,
    )
    clock = FakeClock()
    sched = Scheduler(cfg, KVManager(num_blocks, block_size, num_host_blocks), clock=clock, seed_rng=random.Random(0))
    backend = FakeBackend(
        num_blocks, block_size, num_host_blocks, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds
    )
    return sched, backend, clock


def create_requests(
    n: int,
    *,
    prompt_len: int = 10,
    max_tokens: int = 5,
    request_class: str = "interactive",
    prefix: Sequence[int] = (),
    start: int = 0,
    **kw,
) -> list[AddRequest]:
    out = []
    for i in range(start, start + n):
        body = [(i * 31 + j * 7) % VOCAB for j in range(prompt_len - len(prefix))]
        out.append(
            AddRequest(
                request_id=f"req-{i}",
                reply_channel=f"chan-{i}",
                prompt_token_ids=list(prefix) + body,
                max_tokens=max_tokens,
                request_class=request_class,
                **kw,
            )
        )
    return out


def step(sched: Scheduler, backend: FakeBackend, clock: FakeClock) -> list[EngineOutput]:
    """One loop turn; the fake clock advances by the step's simulated time."""
    plan = sched.schedule()
    out = backend.step(plan)
    clock.advance(out.prefill_seconds + out.decode_seconds)
    return sched.update_from_output(plan, out)


def run_until_done(
    sched: Scheduler, backend: FakeBackend, clock: FakeClock, max_steps: int = 2000, idle: float = 0.01
) -> dict[str, list[EngineOutput]]:
    """Step until no work is left; returns the outputs grouped by request id."""
    by_request: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return by_request
        plan_count = len(backend.plans)
        for output in step(sched, backend, clock):
            by_request.setdefault(output.request_id, []).append(output)
        if backend.plans[plan_count:] and backend.plans[-1].is_empty:
            clock.advance(idle)  # the worker would sleep; time moves on
    raise AssertionError("scheduler did not drain")


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for m in outputs if isinstance(m, TokenEvent) for t in m.token_ids]


def finished_of(outputs: list[EngineOutput]) -> RequestFinished:
    (done,) = [m for m in outputs if isinstance(m, RequestFinished)]
    return done
