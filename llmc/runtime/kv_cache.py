"""Device-free paged KV-cache bookkeeping: which physical blocks hold which sequence's tokens.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a block table (a list
of block ids in token order); the model runner writes token ``i`` of a sequence to slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix sharing: a *full* block whose tokens have all been computed is registered under the hash chain
``hash((parent_hash, block_token_ids))``. A later sequence whose prompt starts with the same tokens reuses
those blocks (reference counted) instead of recomputing them. Blocks whose reference count drops to zero
stay registered and reusable until they are evicted: free blocks are handed out least-recently-freed
first, and a sequence's blocks are freed tail first so a shared prompt head outlives its tails.

Blocks are registered only after their tokens are computed (:meth:`BlockManager.commit`), so a sequence
never skips tokens whose KV entries do not exist yet. Generated tokens count too: once a full block of a sequence's
output is computed it is registered like a prompt block, so the next turn of a chat (whose prompt repeats the
answer) and a sequence recomputed after preemption find it.

Two running totals say how much the prefix cache served: ``queried_tokens`` (tokens of every allocated sequence
that looked the cache up, re-admissions after a preemption included) and ``hit_tokens`` (those found in cached
blocks, not computed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens of a registered (full) block, checked on every hit


@dataclass
class _SeqBlocks:
    """A sequence's block table plus what is needed to register its full blocks once computed."""

    block_ids: list[int]
    num_slots: int  # token slots reserved (<= len(block_ids) * block_size)
    token_ids: tuple[int, ...]  # tokens given at allocation (commit may be given the later ones)
    num_cached_tokens: int  # leading tokens found in the prefix cache at allocation
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the registered leading blocks


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block in a prefix chain: depends on every token before it through ``parent_hash``."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Allocates, shares (prefix cache) and frees KV-cache blocks. Pure bookkeeping: no tensors.

    Paired checks and actions: ``can_allocate``/``allocate`` for a new sequence, ``can_append``/``append``
    to reserve slots for more tokens, ``free`` when a sequence finishes, is aborted or preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[str, _SeqBlocks] = {}
        self.queried_tokens = 0  # tokens of the allocate() calls that looked up the prefix cache (when enabled)
        self.hit_tokens = 0  # of those, tokens found in cached blocks (their KV entries were not computed again)

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free but not yet evicted)."""
        return len(self._hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        """The sequence's block ids in token order (opaque to the scheduler, consumed by the runner)."""
        return tuple(self._seqs[seq_id].block_ids)

    def num_slots(self, seq_id: str) -> int:
        """Token slots reserved for the sequence."""
        return self._seqs[seq_id].num_slots

    def num_cached_tokens(self, seq_id: str) -> int:
        """Leading tokens of the sequence that were already computed (prefix-cache hit at allocation)."""
        return self._seqs[seq_id].num_cached_tokens

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    # -------------------------------------------------------------------------------------- allocation
    def _prefix_hits(self, token_ids: tuple[int, ...], reuse: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` (full blocks only; none when ``reuse`` is
        False: a sequence whose every position must be computed).

        Never covers every token: the last token must be computed to produce logits, and the block it
        lands in must be private because the runner writes to it.
        """
        if not self.enable_prefix_caching or not reuse:
            return []
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = token_ids[start : start + bs]
            h = block_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        if hits and len(hits) * bs >= len(token_ids):
            hits.pop()
        return hits

    def _new_blocks_needed(self, token_ids: tuple[int, ...], hits: list[int]) -> int:
        """Free blocks an allocation consumes: fresh blocks plus cached hits that are currently free."""
        fresh = self.blocks_for(len(token_ids)) - len(hits)
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return fresh + revived

    def can_allocate(self, token_ids: tuple[int, ...] | list[int], reuse: bool = True) -> bool:
        """Whether a new sequence with these tokens fits now (prefix-cache hits need no new block)."""
        token_ids = tuple(token_ids)
        return self._new_blocks_needed(token_ids, self._prefix_hits(token_ids, reuse)) <= len(self._free)

    def allocate(self, seq_id: str, token_ids: tuple[int, ...] | list[int], reuse: bool = True) -> tuple[int, ...]:
        """Reserve slots for every token of a new sequence; returns its block table.

        Leading full blocks found in the prefix cache are shared (see :meth:`num_cached_tokens`) unless ``reuse``
        is False (the sequence's blocks still enter the cache once computed).
        """
        assert seq_id not in self._seqs, f"sequence {seq_id!r} already has blocks"
        token_ids = tuple(token_ids)
        hits = self._prefix_hits(token_ids, reuse)
        assert self._new_blocks_needed(token_ids, hits) <= len(self._free), "allocate without can_allocate"
        for b in hits:
            self._take(b)
        self.queried_tokens += len(token_ids) if reuse else 0
        self.hit_tokens += len(hits) * self.block_size
        fresh = [self._pop_free() for _ in range(self.blocks_for(len(token_ids)) - len(hits))]
        self._seqs[seq_id] = _SeqBlocks(
            block_ids=hits + fresh,
            num_slots=len(token_ids),
            token_ids=token_ids,
            num_cached_tokens=len(hits) * self.block_size,
            block_hashes=[self._blocks[b].hash for b in hits],  # type: ignore[misc]
        )
        return tuple(hits + fresh)

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more slots can be reserved for the sequence."""
        seq = self._seqs[seq_id]
        extra = self.blocks_for(seq.num_slots + num_new_tokens) - len(seq.block_ids)
        return extra <= len(self._free)

    def append(self, seq_id: str, num_new_tokens: int) -> tuple[int, ...]:
        """Reserve ``num_new_tokens`` more slots, taking new blocks as needed; returns the block table."""
        seq = self._seqs[seq_id]
        assert self.can_append(seq_id, num_new_tokens), "append without can_append"
        seq.num_slots += num_new_tokens
        while len(seq.block_ids) * self.block_size < seq.num_slots:
            seq.block_ids.append(self._pop_free())
        return tuple(seq.block_ids)

    def commit(self, seq_id: str, num_computed_tokens: int,
               tokens: Callable[[int, int], tuple[int, ...]] | None = None) -> None:
        """Register the sequence's full blocks whose tokens are now all computed in the prefix cache.

        ``tokens(start, end)``: the sequence's tokens so far (prompt and generated); without it only the tokens
        given at allocation can be registered. A negative id (a sampled token whose value is not known yet)
        stops the registration at its block until a later commit."""
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        limit = (num_computed_tokens if tokens is not None else min(num_computed_tokens, len(seq.token_ids))) // bs
        while len(seq.block_hashes) < limit:
            i = len(seq.block_hashes)
            chunk = seq.token_ids[i * bs : (i + 1) * bs] if tokens is None else tokens(i * bs, (i + 1) * bs)
            if min(chunk) < 0:
                break
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, chunk)
            seq.block_hashes.append(h)
            block = self._blocks[seq.block_ids[i]]
            if h not in self._hash_to_block and block.hash is None:
                block.hash, block.token_ids = h, chunk
                self._hash_to_block[h] = block.block_id

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence (tail first, so shared prompt heads are evicted last)."""
        seq = self._seqs.pop(seq_id)
        for b in reversed(seq.block_ids):
            block = self._blocks[b]
            assert block.ref_count > 0, f"block {b} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    # -------------------------------------------------------------------------------------- internals
    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:  # evict: the block's contents are about to be overwritten
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
