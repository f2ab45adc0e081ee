"""KV page books: which device and host blocks each sequence holds.

The backend owns the memory; this class only decides block ids. A device
block is in exactly one of four states:

* live: ``ref_count > 0`` (held by one or more sequences);
* retained: ``ref_count == 0`` but hashed, so a later prompt with the same
  prefix can claim it; evicted LRU only when the free list runs dry, and
  never counted against a live request (it is available memory);
* pinned: a retained block of a shared prefix (a system block that a burst of
  subagents opens with): evicted only after every unpinned retained block, so
  it outlives ordinary retention but is never counted against a live request;
* free: unhashed, on the free list.

A full prompt block's hash is chained from the previous block's hash, so a
hash names the whole prefix up to that block's end (nano-vllm / vLLM style).
A block is hashed only once its K/V are written (``mark_computed``), so a
claimed block is always complete.

Sliding windows: when every layer slides and the backend never reads behind
the window (``Backend.releases_window_pages``), ``release_behind`` gives back a
decoding sequence's blocks that lie wholly before its window, so a long
generation holds about ``window / block_size + 1`` blocks. The block table
keeps its length (position p still lives at ``block_table[p // block_size]``);
released entries become ``RELEASED`` (-1), always a leading run of
``seq.num_released_blocks`` entries, which backends never read and swaps skip.
A released page goes through the same reference count as ``free``: a block
shared through prefix reuse stays with its other holders, a hashed prompt
block stays retained. Prefix claims walk the hash chain from block 0 and stop
at the first block no longer on device, so a prefix whose head or middle is
gone is never claimed past the gap; a retained block is claimed by the hash of
everything before it, whose K/V it holds whatever its owner released since.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from engine.model_config import ModelConfig
from engine.sequence import Sequence

RELEASED = -1  # a block-table entry behind the window whose page went back to the pool


def release_window(cfg: ModelConfig, backend_releases: bool) -> int | None:
    """The window behind which a sequence's pages may be released (None: never): every
    layer slides and the backend never reads behind the window. The widest layer window
    decides (each layer reads no further back than its own)."""
    if not backend_releases or not cfg.all_layers_slide:
        return None
    return max(cfg.layer_window(i) for i in range(cfg.num_layers))


def block_hash(prev: int | None, tokens: Seq[int] | tuple) -> int:
    return hash((prev, tuple(tokens)))


def block_content(token_ids: Seq[int], images: Seq, i: int, block_size: int) -> tuple:
    """What block ``i`` of a prompt holds, for its hash: its tokens, plus (where it starts
    within the block, content hash) of each image whose placeholders it holds -- the same
    placeholder tokens of another image are other content (engine.models.vision.Image)."""
    lo, hi = i * block_size, (i + 1) * block_size
    chunk = tuple(token_ids[lo:hi])
    marks = tuple((img.offset - lo, img.hash) for img in images if img.offset < hi and img.end > lo)
    return (chunk, marks) if marks else chunk


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.ref_count = [0] * num_blocks
        self.pins = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple] = [()] * num_blocks  # block_content of hashed blocks, to rule out collisions
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # retained, LRU first
        self.evictable_pinned: OrderedDict[int, None] = OrderedDict()  # pinned and unreferenced, LRU first
        self.free_host_blocks: deque[int] = deque(range(num_host_blocks))
        # Host blocks a swap-in is still reading: a plan runs its swap-outs first,
        # so they may not take a new page until the plan has run (end_step()).
        self.host_blocks_in_flight: list[int] = []
        self.num_prefix_hits = 0  # requests that claimed at least one block
        self.num_cached_tokens = 0  # tokens those claims skipped

    # -- sizes ---------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available_blocks(self) -> int:
        """Free plus evictable retained blocks (pinned ones included: they only go last)."""
        return len(self.free_blocks) + len(self.evictable) + len(self.evictable_pinned)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that hold nothing (taking one evicts no retained prefix)."""
        return len(self.free_blocks)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host_blocks)

    def usage(self) -> dict[str, int]:
        """The pool's books by state. O(1): the engine publishes them with every status (a walk over
        the reference counts was 29k steps a status for an 8B on one card, on the engine's loop)."""
        used = self.num_blocks - self.num_available_blocks  # the four states partition the pool
        pinned = len(self.evictable_pinned)
        return {
            "total": self.num_blocks,
            "used": used,
            "retained": len(self.evictable) + pinned,
            "pinned": pinned,
            "free": len(self.free_blocks),
            "host_total": self.num_host_blocks,
            "host_used": self.num_host_blocks - len(self.free_host_blocks) - len(self.host_blocks_in_flight),
        }

    # -- prefix matching -----------------------------------------------------

    def _match(self, token_ids: Seq[int], max_blocks: int, images: Seq = ()) -> list[tuple[int, int]]:
        """(block, hash) for the longest run of retained/live full blocks prefixing ``token_ids``
        (with ``images`` at their placeholders)."""
        out: list[tuple[int, int]] = []
        prev: int | None = None
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            chunk = block_content(token_ids, images, i, bs)
            h = block_hash(prev, chunk)
            b = self.hash_to_block.get(h)
            if b is None or self.tokens[b] != chunk:
                break
            out.append((b, h))
            prev = h
        return out

    def _claimable(self, seq: Sequence) -> list[tuple[int, int]]:
        # Leave the last prompt token to compute: prefill must sample from it. A request scoring
        # its prompt claims nothing: every position must run to give its logits.
        if seq.prompt_logprobs is not None:
            return []
        return self._match(seq.prompt_token_ids, (seq.num_prompt_tokens - 1) // self.block_size, seq.images)

    def num_claimable_tokens(self, seq: Sequence) -> int:
        """Prompt tokens ``allocate(seq)`` would claim from retained state now."""
        return len(self._claimable(seq)) * self.block_size

    def num_blocks_to_allocate(self, seq: Sequence) -> int:
        """Available blocks ``allocate(seq)`` would take (claiming a retained block takes one)."""
        hits = self._claimable(seq)
        live_hits = sum(1 for b, _ in hits if self.ref_count[b] > 0)
        return self.blocks_for(seq.num_tokens) - live_hits

    def can_allocate(self, num_tokens: int, seq: Sequence | None = None) -> bool:
        """Whether ``num_tokens`` fresh slots fit (with ``seq``: its prompt, prefix hits included)."""
        need = self.num_blocks_to_allocate(seq) if seq is not None else self.blocks_for(num_tokens)
        return need <= self.num_available_blocks

    # -- allocation ----------------------------------------------------------

    def _take_block(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        b, _ = (self.evictable or self.evictable_pinned).popitem(last=False)
        self.pins[b] = 0
        self._unhash(b)
        return b

    def _unhash(self, b: int) -> None:
        h = self.hashes[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.hashes[b] = None
        self.tokens[b] = ()

    def _claim(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self.evictable.pop(b, None)
            self.evictable_pinned.pop(b, None)
        self.ref_count[b] += 1

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.pins[b]:
                self.evictable_pinned[b] = None
            elif self.hashes[b] is not None:
                self.evictable[b] = None
                self.evictable.move_to_end(b)
            else:
                self.free_blocks.append(b)

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its tokens (its prompt, plus any output when it
        recomputes after a preemption), claiming the longest retained prompt prefix;
        returns the number of cached tokens (also set on the seq)."""
        assert not seq.block_table, "allocate() on a sequence that holds blocks"
        if not self.can_allocate(0, seq):
            raise MemoryError("KV pool exhausted")
        hits = self._claimable(seq)
        for b, _ in hits:
            self._claim(b)
        seq.block_table = [b for b, _ in hits]
        seq.block_hashes = [h for _, h in hits]
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            b = self._take_block()
            self.ref_count[b] = 1
            seq.block_table.append(b)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if hits:
            self.num_prefix_hits += 1
            self.num_cached_tokens += seq.num_cached_tokens
        return seq.num_cached_tokens

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that positions < ``num_computed_tokens`` hold K/V; hash full prompt blocks."""
        seq.num_computed_tokens = num_computed_tokens
        bs = self.block_size
        full = min(num_computed_tokens, seq.num_prompt_tokens) // bs
        for i in range(len(seq.block_hashes), full):
            chunk = block_content(seq.prompt_token_ids, seq.images, i, bs)
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(h)
            b = seq.block_table[i]
            if b != RELEASED and h not in self.hash_to_block and self.hashes[b] is None:
                self.hashes[b], self.tokens[b] = h, chunk
                self.hash_to_block[h] = b

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to hold ``num_tokens`` positions; False if the pool is dry."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_available_blocks:
            return False
        for _ in range(need):
            b = self._take_block()
            self.ref_count[b] = 1
            seq.block_table.append(b)
        return True

    def release_behind(self, seq: Sequence, first_position: int) -> int:
        """Give back ``seq``'s blocks lying wholly before ``first_position`` (no query reads
        there again: behind every layer's window); returns how many went back."""
        n = seq.num_released_blocks
        end = min(max(0, first_position) // self.block_size, len(seq.block_table))
        hashed = False
        for i in range(n, end):
            b = seq.block_table[i]
            hashed |= self.hashes[b] is not None
            seq.block_table[i] = RELEASED
            self._release(b)
        seq.num_released_blocks = max(n, end)
        if hashed:  # released head-first; let the LRU still evict a prompt's tail before its head
            for h in reversed(seq.block_hashes[: seq.num_released_blocks]):
                b = self.hash_to_block.get(h)
                if b is not None and b in self.evictable:
                    self.evictable.move_to_end(b)
        return max(0, end - n)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s table blocks past those ``num_tokens`` positions need (blocks a
        verify round took for drafts that were rejected)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def rewind(self, seq: Sequence, num_valid: int) -> None:
        """``seq``'s output was cut back (a take-back): only positions < ``num_valid`` keep their
        K/V; blocks past ``seq.num_tokens`` go back. Output positions are never hashed."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_valid)
        self.trim(seq, seq.num_tokens)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s device and host blocks; hashed (prompt) blocks stay retained.
        Released tail-first so the LRU evicts a prompt's tail before its head."""
        n = seq.num_released_blocks
        for b in reversed(seq.block_table[n:]):
            self._release(b)
        self.free_host_blocks.extend(seq.host_block_table[n:])
        seq.block_table, seq.host_block_table, seq.num_released_blocks = [], [], 0

    # -- host tier -----------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) - seq.num_released_blocks <= len(self.free_host_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s pages to host blocks; returns (device, host) copies to run.
        Released entries stay RELEASED in the host table: nothing to copy."""
        assert self.can_swap_out(seq)
        n = seq.num_released_blocks
        pairs = [(b, self.free_host_blocks.popleft()) for b in seq.block_table[n:]]
        for b in reversed(seq.block_table[n:]):
            self._release(b)  # a hashed block stays retained on device too
        seq.host_block_table = [RELEASED] * n + [h for _, h in pairs]
        seq.block_table = []
        return pairs

    def _swap_in_hits(self, seq: Sequence) -> list[int]:
        """Device blocks still holding ``seq``'s hashed prompt blocks, in order from its
        first unreleased one (each named by the hash of its whole prefix)."""
        hits, bs = [], self.block_size
        for i in range(seq.num_released_blocks, min(len(seq.block_hashes), len(seq.host_block_table))):
            b = self.hash_to_block.get(seq.block_hashes[i])
            if b is None or self.tokens[b] != block_content(seq.prompt_token_ids, seq.images, i, bs):
                break
            hits.append(b)
        return hits

    def can_swap_in(self, seq: Sequence, num_tokens: int = 0) -> bool:
        """Whether ``seq``'s pages come back and it then holds ``num_tokens`` positions."""
        hits = self._swap_in_hits(seq)
        held = len(seq.host_block_table) - seq.num_released_blocks
        need = held - sum(1 for b in hits if self.ref_count[b] > 0)
        need += max(0, self.blocks_for(num_tokens) - len(seq.host_block_table))
        return need <= self.num_available_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq``'s pages back; returns (host, device) copies to run. Blocks
        whose content is still on device (retained by hash) are claimed, not copied;
        released entries stay RELEASED."""
        n = seq.num_released_blocks
        hits = self._swap_in_hits(seq)
        for b in hits:
            self._claim(b)
        table, pairs = [RELEASED] * n + hits, []
        for host in seq.host_block_table[n + len(hits) :]:
            b = self._take_block()
            self.ref_count[b] = 1
            table.append(b)
            pairs.append((host, b))
        self.host_blocks_in_flight.extend(seq.host_block_table[n:])
        seq.block_table, seq.host_block_table = table, []
        return pairs

    def end_step(self) -> None:
        """The plan that swapped pages in has run: their host blocks are free."""
        self.free_host_blocks.extend(self.host_blocks_in_flight)
        self.host_blocks_in_flight.clear()

    # -- shared prefixes -----------------------------------------------------

    def pin_prefix(self, token_ids: Seq[int], images: Seq = ()) -> int:
        """Mark the computed full blocks prefixing ``token_ids`` (e.g. a system block; ``images``
        at their placeholders) as a shared prefix: evicted only after every unpinned retained
        block. Idempotent; returns the pinned token count."""
        hits = self._match(token_ids, len(token_ids) // self.block_size, images)
        for b, _ in hits:
            if not self.pins[b]:
                self.pins[b] = 1
                if self.ref_count[b] == 0:
                    self.evictable.pop(b, None)
                    self.evictable_pinned[b] = None
        return len(hits) * self.block_size

    def unpin_prefix(self, token_ids: Seq[int]) -> int:
        hits = [b for b, _ in self._match(token_ids, len(token_ids) // self.block_size) if self.pins[b]]
        for b in hits:
            self.pins[b] = 0
            if self.ref_count[b] == 0:
                self.evictable_pinned.pop(b, None)
                self.evictable[b] = None
        return len(hits) * self.block_size
