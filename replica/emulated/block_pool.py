"""The emulated engine's KV block pool and prefix cache, with vLLM v1's semantics.

Blocks are ids ``0..num_blocks-1`` with a reference count.  Block 0 is vLLM's *null block*: its
``BlockPool`` takes it out of the free queue at start (a placeholder for skipped blocks), so a
cache of ``num_gpu_blocks`` blocks holds ``num_gpu_blocks - 1`` of content (``usable``).  A full block of a prompt gets its chain
hash and is *cached*: later requests whose chain starts the same way reuse it.  When its last user
lets go it joins the free queue but keeps its hash, so it still hits, until the queue hands it out
for new content (least recently freed first); only then is it evicted, which emits BlockRemoved.
As in vLLM, identical content computed twice is not de-duplicated: a hash may name several blocks,
and evicting one of them emits BlockRemoved although another copy may remain.

Events are queued in ``events``; the engine drains them once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice, takewhile

from kvroute.replica.emulated.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

NULL_BLOCK = 0  # never handed out, never freed (vLLM's placeholder block)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = True):
        if num_blocks < 2 or block_size <= 0:
            raise ValueError("num_blocks must be >= 2 (one is the null block) and block_size positive")
        self.num_blocks = num_blocks
        self.usable = num_blocks - 1  # without the null block
        self.block_size = block_size
        self.ref_count: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (head = next handed out); an OrderedDict gives O(1) popleft,
        # append and removal from the middle (a cache hit on a free block), like vLLM's linked list.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK + 1, num_blocks))
        self._cached: dict[int, int] = {}  # hash -> the block a lookup returns
        self._copies: dict[int, list[int]] = {}  # hash -> further blocks holding the same content
        self.events: list[KVEvent] = []
        self.record_events = record_events  # False: nobody listens, skip building events

    # --- observation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no user (never used, or cached and evictable)."""
        return len(self._free)

    def free_queue_len(self) -> int:
        """``num_free`` as a bound method, for hot loops."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Usable blocks with a user (the null block is neither used nor free)."""
        return self.usable - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hash (in use or free)."""
        return len(self._cached) + sum(len(c) for c in self._copies.values())

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    # --- prefix cache ------------------------------------------------------------------------
    def longest_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``, at most ``max_blocks`` of them."""
        cached = self._cached
        # map/takewhile keep the scan in C: it runs for every admission.
        return list(map(cached.__getitem__, takewhile(cached.__contains__, islice(hashes, max_blocks))))

    def num_unreferenced(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them consumes free capacity)."""
        ref = self.ref_count
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache hits; a free one leaves the free queue (it is no longer evictable)."""
        ref, free = self.ref_count, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for new content, least recently freed first, evicting their old hashes."""
        free = self._free
        if n > len(free):
            raise ValueError(f"cannot allocate {n} blocks, {len(free)} free")
        ref, bhash, cached, copies = self.ref_count, self.block_hash, self._cached, self._copies
        popleft = free.popitem
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            b = popleft(last=False)[0]
            h = bhash[b]
            if h is not None:
                bhash[b] = None
                if h in copies:
                    self._evict_copy(b, h)
                else:  # the only block holding h
                    del cached[h]
                evicted.append(h)
            ref[b] = 1
            out.append(b)
        if evicted and self.record_events:
            self.events.append(BlockRemoved(evicted))
        return out

    def cache(self, blocks: Sequence[int], hashes: Sequence[int], start: int, end: int,
              token_ids: Sequence[int] | None) -> None:
        """Register ``blocks[start:end]`` as holding ``hashes[start:end]`` (full, computed blocks)."""
        if start >= end:
            return
        bhash, cached, copies = self.block_hash, self._cached, self._copies
        for i in range(start, end):
            b, h = blocks[i], hashes[i]
            bhash[b] = h
            if cached.setdefault(h, b) != b:
                copies.setdefault(h, []).append(b)
        if not self.record_events:
            return
        bs = self.block_size
        tokens = list(token_ids[start * bs:end * bs]) if token_ids is not None else []
        self.events.append(BlockStored(list(hashes[start:end]),
                                       hashes[start - 1] if start > 0 else None, tokens, bs))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; those left unused join the free queue in this order
        (so the first ones given are evicted first: callers pass a request's blocks tail first).

        As in vLLM's ``BlockPool.free_blocks``: blocks holding a hash join the queue's tail (LRU
        eviction of cached content); blocks holding none (a prompt's partial last block, output
        blocks) go to its head, to be handed out first, so they never push cached blocks out.
        """
        ref, free, bhash = self.ref_count, self._free, self.block_hash
        unhashed: list[int] = []
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0:
                if bhash[b] is None:
                    unhashed.append(b)
                else:
                    free[b] = None
        for b in reversed(unhashed):  # prepended in the order given, like vLLM's prepend_n
            free[b] = None
            free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every hash (vLLM's reset_prefix_cache); refused while any block is in use."""
        if self.num_used:
            return False
        bhash = self.block_hash
        for b in self._cached.values():
            bhash[b] = None
        for blocks in self._copies.values():
            for b in blocks:
                bhash[b] = None
        self._cached.clear()
        self._copies.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def _evict_copy(self, block: int, h: int) -> None:
        """Forget that ``block`` holds ``h``, which other blocks also hold."""
        copies = self._copies[h]
        if self._cached[h] == block:
            self._cached[h] = copies.pop(0)
        else:
            copies.remove(block)
        if not copies:
            del self._copies[h]

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        ref, free = self.ref_count, self._free
        assert all(r >= 0 for r in ref), "negative reference count"
        assert ref[NULL_BLOCK] == 0 and NULL_BLOCK not in free and self.block_hash[NULL_BLOCK] is None
        for b in range(NULL_BLOCK + 1, self.num_blocks):
            assert (ref[b] == 0) == (b in free), f"block {b}: ref {ref[b]} but free={b in free}"
        holders: dict[int, list[int]] = {}
        for b, h in enumerate(self.block_hash):
            if h is not None:
                holders.setdefault(h, []).append(b)
        listed = {h: [b, *self._copies.get(h, [])] for h, b in self._cached.items()}
        assert set(self._copies) <= set(self._cached), "copies of an uncached hash"
        assert {h: sorted(bs) for h, bs in holders.items()} == {h: sorted(bs) for h, bs in listed.items()}
        assert self.num_cached <= self.usable
