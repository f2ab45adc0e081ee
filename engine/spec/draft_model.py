"""A draft model: a small model with the target's tokenizer proposing every speculating lane's drafts.

It runs on its own backend instance (the target's kind) with its own small KV pool and books
(a ``KVManager`` of its own), beside the target in the same process. Per scheduler step,
``propose`` brings each lane's draft cache up to the lane's committed tokens (a prefill span of
what it has not seen: the prompt the first time, then the tokens the last verify round committed;
a cached prefix that the committed tokens contradict is rewound first), then runs ``max(k)``
batched greedy decode rounds over the lanes still drafting. Drafts are the draft model's greedy
tokens: single proposals, checked by the target's verify rows like any other drafter's
(engine/spec/verify.accept_sampled), so the output is the target's whatever the draft says.

When the draft pool runs dry, the least recently used lanes' draft caches are dropped (they are
rebuilt by a prefill when those lanes draft again); a lane that still does not fit drafts nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.backend import Backend, DecodeLane, PrefillSpan, SampleRequest, StepOutput
from engine.kv_manager import KVManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence

GREEDY = SampleRequest(params=SamplingParams(temperature=0.0), seed=0)


@dataclass(eq=False)
class _Shadow:
    """The draft model's view of one target sequence: the tokens whose K/V its cache holds."""

    books: Sequence  # only its block table is used (the draft pool's KVManager keeps it)
    tokens: list[int] = field(default_factory=list)


class DraftProposer:
    """The per-sequence drafter object of a lane that the draft model serves (engine/spec/rounds)."""

    name = "draft_model"

    def commit(self, tokens: Seq[int]) -> None:
        """Nothing to keep here: the draft model reads the sequence's tokens when it drafts."""

    def propose(self, k: int) -> list[int]:
        return []  # drafts come batched from DraftModel.propose, not one lane at a time


class DraftModel:
    name = "draft_model"

    def __init__(self, backend: Backend, num_blocks: int, block_size: int, prefill_chunk: int = 1024) -> None:
        self.backend = backend
        self.kv = KVManager(num_blocks, block_size, 0)
        self.prefill_chunk = prefill_chunk
        self.shadows: OrderedDict[int, _Shadow] = OrderedDict()  # seq_id -> cache, least recent first

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy draft tokens to follow each of ``seqs``' committed tokens."""
        drafts: list[list[int]] = [[] for _ in seqs]
        lanes = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k > 0 and (shadow := self._sync(seq, k)) is not None:
                lanes.append((i, seq, shadow, k))
        for step in range(max((k for *_, k in lanes), default=0)):
            rows = [(i, seq, sh) for i, seq, sh, k in lanes if len(drafts[i]) < k]
            batch = []
            for i, seq, sh in rows:
                token = seq.last_token_id if step == 0 else drafts[i][-1]
                batch.append(DecodeLane(seq.seq_id, token, len(sh.tokens), list(sh.books.block_table), GREEDY))
            out = StepOutput()
            self.backend.decode_round(batch, out)
            for (i, _, sh), lane, token in zip(rows, batch, out.decode_tokens):
                sh.tokens.append(lane.token_id)
                drafts[i].append(int(token))
        return drafts

    def release(self, seq_id: int) -> None:
        """The target sequence is gone: its draft cache's pages go back."""
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.kv.free(shadow.books)

    def _sync(self, seq: Sequence, k: int) -> _Shadow | None:
        """``seq``'s draft cache holding its committed tokens but the last, with room for ``k`` more
        (None when the pool cannot hold it even after dropping every other lane's cache)."""
        known = seq.prompt_token_ids + seq.output_token_ids
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is None:
            shadow = _Shadow(Sequence(seq.seq_id, seq.request_id, [], 0, GREEDY.params, 0))
        self.shadows[seq.seq_id] = shadow  # most recently used
        common = 0
        for a, b in zip(shadow.tokens, known[:-1]):
            if a != b:
                break
            common += 1
        del shadow.tokens[common:]  # drafts the target rejected, or a rewound sequence
        while not self.kv.append_slots(shadow.books, len(known) - 1 + k):
            victim = next((s for s in self.shadows if s != seq.seq_id), None)
            if victim is None:
                self.release(seq.seq_id)
                return None
            self.release(victim)
        todo = known[len(shadow.tokens) : -1]
        for start in range(0, len(todo), self.prefill_chunk):
            chunk = todo[start : start + self.prefill_chunk]
            span = PrefillSpan(seq.seq_id, chunk, len(shadow.tokens), list(shadow.books.block_table))
            self.backend.prefill(span, StepOutput())
            shadow.tokens += chunk
        return shadow
