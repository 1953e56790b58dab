"""In-memory prefix index, for a single router (and the simulator, on a virtual clock) (docs/design.md §3.4).

Each replica keeps one ordered map, block hash -> expiry, least recently used first: it is the
LRU and the entry store at once, so a write touches one dict per block.

Next to them, one map block hash -> bitmask of the replicas holding it (each replica owns one bit
while it is registered, and a bit freed by a removed replica goes to the next one added).  A
lookup reads one mask per block of the chain, whatever the number of replicas, in one C loop
(``itemgetter``): a hot conversation held whole by several replicas costs one probe per block,
not one per block and replica.  Masks are Python ints, so there is no limit on replicas and no
slower path past 64 of them.  A replica's run ends at the first mask without its bit: ``count``
tells when every block has the same holders (the common case); else, with few distinct masks
(replicas sharing a system prompt, one holding the conversation after it), ``list.index`` finds
where each first appears, and with more, a running AND of the masks (``accumulate``), which only
ever loses bits and so never increases, is bisected.  Before any of that, probes of blocks 8, 16,
32, ... and the last bound the scan, so replicas sharing only a chain's head cost a few probes and
a new turn's blocks, held by nobody yet, are not read.

Renewing a prediction costs a new expiry and a purge record per block, so a chain re-predicted
within ``renew_slack_s`` (default an eighth of the TTL) of its last renewal keeps its expiry and
is only touched in the LRU: a conversation's earlier turns are renewed once per slack, not on
every request (two C scans tell; a prediction may so expire up to the slack sooner than "TTL
after its last use").

The masks say "held", not "live": a TTL prediction past its expiry stays until it is purged.
So a lookup first purges the expired predictions of the replicas holding the chain's head, then
trusts the masks.  Purging is a walk from the front of a deque because each replica's
predictions are kept in expiry order (if the clock steps back, they are re-sorted).  Only
entries that appear or go touch the masks, in bulk C maps: renewing the blocks of a conversation
seen before costs nothing extra, and a new block or an eviction costs one more dict operation.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import accumulate, compress, islice, repeat
from operator import and_, is_not, itemgetter, neg, or_

from kvroute.router.index.base import PrefixIndex, ReplicaSpec

# An entry's value is its expiry time; these two mark entries that never expire.
CONFIRMED = -1.0
PINNED = math.inf  # predicted, on a replica without KV events

MEMBERS_MEMO_SIZE = 4096  # distinct holder masks whose replica lists are kept
FEW_HOLDER_SETS = 4  # up to this many distinct masks in a run, ``list.index`` finds where each starts


class _Replica:
    __slots__ = ("spec", "bit", "entries", "expiries", "confirmed")

    def __init__(self, spec: ReplicaSpec, bit: int):
        self.spec = spec
        self.bit = bit  # 1 << its position in MemoryIndex._by_bit
        self.entries: OrderedDict[int, float] = OrderedDict()  # block hash -> expiry, least recent first
        self.confirmed = 0  # entries whose value is CONFIRMED: each class has its own capacity bound
        self.expiries: deque[tuple[float, int]] = deque()  # (expiry, hash) of TTL predictions, in expiry order


def _bound(holders: dict[int, int], chain: Sequence[int], head: int) -> int:
    """A length no run of the head's holders exceeds, usually the longest run itself.

    Blocks 8, 16, 32, ... and the last are probed; between the last probe some holder still held
    and the first none did, a bisection narrows the bound.  Replicas that share only a chain's
    head (a common system prompt) then cost a few probes, and a new turn's blocks, held by
    nobody yet, are left out of the scan.
    """
    n = len(chain)
    held, lo, probe = head, 0, 8
    while True:
        probe = min(probe, n - 1)
        still = held & holders.get(chain[probe], 0)
        if not still:
            break
        if probe == n - 1:
            return n
        held, lo, probe = still, probe, probe * 2
    hi = probe
    while hi - lo > 1:
        mid = (lo + hi) // 2
        still = held & holders.get(chain[mid], 0)
        if still:
            held, lo = still, mid
        else:
            hi = mid
    return hi


class MemoryIndex(PrefixIndex):
    """In this process: every call is synchronous underneath, so ``IndexClient`` calls
    ``lookup_now`` and ``record_prediction_now`` directly (no timeout, no task)."""

    def __init__(
        self,
        predicted_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        renew_slack_s: float | None = None,
    ):
        self.predicted_ttl_s = predicted_ttl_s
        self.renew_slack_s = predicted_ttl_s / 8 if renew_slack_s is None else renew_slack_s
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[int, int] = {}  # block hash -> bits of the replicas holding it
        self._by_bit: list[_Replica | None] = []  # the replica owning each bit; None: free
        self._members: dict[int, tuple[_Replica, ...]] = {}  # memo: holder mask -> its replicas

    # -- replicas -------------------------------------------------------------------------
    async def add_replica(self, spec: ReplicaSpec) -> None:
        rep = self._replicas.get(spec.name)
        if rep is None:
            by_bit = self._by_bit
            position = by_bit.index(None) if None in by_bit else len(by_bit)  # the lowest free bit
            rep = self._replicas[spec.name] = _Replica(spec, 1 << position)
            if position == len(by_bit):
                by_bit.append(rep)
            else:
                by_bit[position] = rep
                self._members.clear()  # masks with this bit named the replica that had it
            return
        rep.spec = spec
        self._expire(rep, self.clock())
        self._evict_over_capacity(rep)

    async def remove_replica(self, name: str) -> None:
        rep = self._replicas.pop(name, None)
        if rep is None:
            return
        self._drop_bit(list(rep.entries), rep.bit)
        self._by_bit[rep.bit.bit_length() - 1] = None  # free for the next replica added

    async def clear_replica(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        self._drop_bit(list(rep.entries), rep.bit)
        rep.entries.clear()
        rep.expiries.clear()
        rep.confirmed = 0

    async def drop_confirmed(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        entries = rep.entries
        confirmed = [h for h, expiry in entries.items() if expiry == CONFIRMED]
        for h in confirmed:
            del entries[h]
        rep.confirmed = 0
        self._drop_bit(confirmed, rep.bit)

    async def entry_count(self, name: str) -> int:
        rep = self._replicas.get(name)
        if rep is None:
            return 0
        self._expire(rep, self.clock())
        return len(rep.entries)

    # -- lookups --------------------------------------------------------------------------
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        return self.lookup_now(chain)

    def lookup_now(self, chain: Sequence[int]) -> dict[str, int]:
        if not chain:
            return {}
        holders = self._holders
        head = holders.get(chain[0])
        if head is None:
            return {}
        now = self.clock()
        purged = False
        for rep in self._members_of(head):
            q = rep.expiries
            if q and q[0][0] <= now:
                self._expire(rep, now)
                purged = True
        if purged:  # every entry left is live: the masks can be trusted
            head = holders.get(chain[0])
            if head is None:
                return {}
        end = _bound(holders, chain, head)
        try:
            masks = itemgetter(*chain[:end])(holders) if end > 1 else (head,)
        except KeyError:  # a block nobody holds: every run stops there
            masks = list(map(holders.get, chain[:end], repeat(0)))
            del masks[masks.index(0) :]
        n = len(masks)
        if masks.count(head) == n:  # the same holders all along
            return {rep.spec.name: n for rep in self._members_of(head)}
        return self._runs(masks, head)

    def _runs(self, masks: Sequence[int], head: int) -> dict[str, int]:
        """Each head holder's leading run, from the blocks' holder masks (``masks[0] == head``)."""
        n = len(masks)
        matched: dict[str, int] = {}
        distinct = set(masks)
        if len(distinct) <= FEW_HOLDER_SETS:
            # A bit is lost where the first mask without it appears: visit each mask's first
            # appearance in order.  Typical: the head's holders share a system prompt, one holds
            # the conversation after it.
            alive = head
            for first, mask in sorted(zip(map(masks.index, distinct), distinct)):
                for rep in self._members_of(alive & ~mask):
                    matched[rep.spec.name] = first
                alive &= mask
            for rep in self._members_of(alive):
                matched[rep.spec.name] = n
            return matched
        running = list(accumulate(masks, and_))  # each value a subset of the one before: non-increasing
        alive, start = head, 0
        while alive:
            end = bisect_right(running, -alive, lo=start, key=neg)  # the first value below `alive`
            if end == n:
                for rep in self._members_of(alive):
                    matched[rep.spec.name] = n
                break
            for rep in self._members_of(alive & ~running[end]):
                matched[rep.spec.name] = end
            alive, start = running[end], end
        return matched

    def _members_of(self, mask: int) -> tuple[_Replica, ...]:
        members = self._members.get(mask)
        if members is None:
            if len(self._members) >= MEMBERS_MEMO_SIZE:
                self._members.clear()
            by_bit = self._by_bit
            members = tuple(by_bit[i] for i in range(mask.bit_length()) if mask >> i & 1)  # type: ignore[misc]
            self._members[mask] = members
        return members

    # -- writes ---------------------------------------------------------------------------
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> bool:
        self.record_prediction_now(replica, chain)
        return replica in self._replicas

    def record_prediction_now(self, replica: str, chain: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None or not chain:
            return
        now = self.clock()
        self._expire(rep, now)
        expiry = now + self.predicted_ttl_s if rep.spec.publishes_events else PINNED
        self._write(rep, chain, expiry)

    async def confirm(self, replica: str, hashes: Sequence[int]) -> bool:
        rep = self._replicas.get(replica)
        if rep is None:
            return False
        self._expire(rep, self.clock())  # expired predictions must not take capacity
        self._write(rep, hashes, CONFIRMED)
        return True

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        gone = list(map(rep.entries.pop, hashes, repeat(None)))
        rep.confirmed -= gone.count(CONFIRMED)
        self._drop_bit(list(compress(hashes, map(is_not, gone, repeat(None)))), rep.bit)

    # -- internals ------------------------------------------------------------------------
    def _write(self, rep: _Replica, hashes: Sequence[int], expiry: float) -> None:
        """Set entries (a confirmation is never downgraded to a prediction) and touch the LRU.

        The chain is touched backwards so that its head ends up most recently used: capacity
        eviction then takes tails first, as the engine's own free queue does, instead of the
        shared head that every longer prefix depends on.  Values are set first and the recency
        moves done after, in one C loop: setting a value never moves a key, so the resulting order
        is the same as touching block by block, and most blocks of a chain seen before (the
        earlier turns of a conversation) need no new value at all.
        """
        entries = rep.entries
        old = list(map(entries.get, hashes))
        if expiry != PINNED and expiry != CONFIRMED:  # a TTL prediction
            fresh = self._fresh_run(old, float(expiry - self.renew_slack_s))
            if fresh < len(old):
                self._set_values(rep, hashes[fresh:], old[fresh:], expiry, timed=True)
        elif old.count(expiry) + (expiry != CONFIRMED and old.count(CONFIRMED)) != len(old):
            self._set_values(rep, hashes, old, expiry, timed=False)
        # deque(maxlen=0) consumes the map in C
        deque(map(entries.move_to_end, reversed(hashes)), maxlen=0)
        self._evict_over_capacity(rep)

    @staticmethod
    def _fresh_run(old: list[float | None], renewed_after: float) -> int:
        """How many leading entries need no new expiry: all the held ones up to the first block
        not held, if each is confirmed or expires after ``renewed_after``; else 0 (renew all)."""
        held = old.index(None) if None in old else len(old)
        run = old[:held] if held < len(old) else old
        # C scans: entries older than the slack, less the confirmed ones (-1.0) they count
        stale = sum(map(renewed_after.__gt__, run)) - run.count(CONFIRMED)
        return held if stale == 0 and PINNED not in run else 0

    def _set_values(
        self, rep: _Replica, hashes: Sequence[int], old: list[float | None], expiry: float, timed: bool
    ) -> None:
        entries, expiries = rep.entries, rep.expiries
        out_of_order = timed and expiries and expiries[-1][0] > expiry  # the clock stepped back
        confirming = expiry == CONFIRMED
        new = []  # blocks this replica did not hold: they gain its bit
        for h, was in zip(reversed(hashes), reversed(old)):
            if was == CONFIRMED and not confirming:
                continue  # confirmed already: only its recency is refreshed
            if was == expiry and not timed:
                continue
            if confirming:
                if entries.get(h) == CONFIRMED:
                    continue  # a block repeated in the chain, confirmed just now
                rep.confirmed += 1
            entries[h] = expiry
            if timed:
                expiries.append((expiry, h))
            if was is None:
                new.append(h)
        if out_of_order:
            rep.expiries = deque(sorted(expiries))  # purging walks them in expiry order
        if new:
            self._add_bit(new, rep.bit)

    def _add_bit(self, hashes: list[int], bit: int) -> None:
        """These blocks are now held by the replica owning ``bit`` (repeats allowed)."""
        holders = self._holders
        # One probe each for the usual new block, held by nobody else: it gets `bit` alone.
        masks = list(map(holders.setdefault, hashes, repeat(bit)))
        if masks.count(bit) != len(masks):  # some were held by others already
            holders.update(zip(hashes, map(or_, masks, repeat(bit))))

    def _drop_bit(self, hashes: list[int], bit: int) -> None:
        """These blocks (no repeats) are no longer held by the replica owning ``bit``."""
        if not hashes:
            return
        holders = self._holders
        # Popped, then put back where others still hold them: the usual sole holder costs one pop.
        others = list(map(and_, map(holders.pop, hashes), repeat(~bit)))
        if any(others):
            holders.update(compress(zip(hashes, others), others))

    def _evict_over_capacity(self, rep: _Replica) -> None:
        """Predictions and confirmed entries are bounded apart, each at the replica's capacity,
        least recently used first: a prediction never evicts what the engine said it stores
        (its BlockRemoved says when that goes), and confirmed entries past what the engine can
        hold are stale (lost events), so they go."""
        entries, capacity, confirmed = rep.entries, max(rep.spec.capacity_blocks, 0), rep.confirmed
        excess = len(entries) - confirmed - capacity
        if excess > 0:
            if confirmed:  # the least recent predictions, skipping confirmed entries, in C
                predicted = compress(entries, map(CONFIRMED.__ne__, entries.values()))
                victims = list(islice(predicted, excess))
                deque(map(entries.__delitem__, victims), maxlen=0)
            else:
                popitem = entries.popitem
                victims = [popitem(last=False)[0] for _ in range(excess)]
            self._drop_bit(victims, rep.bit)
        excess = confirmed - capacity
        if excess > 0:
            victims = list(islice(compress(entries, map(CONFIRMED.__eq__, entries.values())), excess))
            deque(map(entries.__delitem__, victims), maxlen=0)
            rep.confirmed -= len(victims)
            self._drop_bit(victims, rep.bit)

    def _expire(self, rep: _Replica, now: float) -> None:
        """Drop TTL predictions that ran out (and were neither confirmed nor renewed)."""
        q = rep.expiries
        if not q or q[0][0] > now:
            return
        entries = rep.entries
        gone = []
        while q and q[0][0] <= now:
            expiry, h = q.popleft()
            if entries.get(h) == expiry:
                del entries[h]
                gone.append(h)
        self._drop_bit(gone, rep.bit)
