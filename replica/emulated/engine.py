"""An emulated vLLM-v1 engine in virtual time: prefix cache, scheduler and step timing.

Scheduling follows vLLM v1's ``Scheduler.schedule`` (FCFS, chunked prefill, recompute preemption):

* Each step has a budget of ``max_num_batched_tokens``.  Running requests come first, in admission
  order, each taking what it still needs (1 token for a decode, the rest of its prompt, capped by
  the budget, for a prefill in progress).  A running request that cannot get the blocks it needs
  preempts the most recently admitted running request (its blocks are freed, it goes back to the
  head of the waiting queue and is recomputed later), possibly itself.
* Then, if nobody was preempted, waiting requests are admitted in FIFO order while the budget,
  ``max_num_seqs`` and the free blocks allow; the first that does not fit stops the queue.
  On admission a request's prefix-cache hit is the longest run of its block hashes in the cache,
  capped so that at least its last token is computed; blocks are allocated for the chunk only.
* Blocks become cached when the step that computes them is scheduled (as in vLLM, whose
  ``allocate_slots`` caches them then: a request scheduled later in the same step may already hit
  them, which is sound because a forward pass writes each layer's KV before reading it).  The KV
  events of a step are delivered when it completes.
* The step that computes a request's last uncomputed token samples its next token: the first
  token when its prefill completes, then one per decode step.  Finished requests free their blocks
  (tail first, so a chain's tail is evicted before its head).

Only prompt blocks are hashed: the engine does not know generated tokens' ids, so blocks holding
output are never cached (vLLM would cache them; a follow-up turn's prompt would then hit them too).

Time is virtual: a step starts when the previous one ends (or when work arrives at an idle engine)
and lasts ``profile.step_time(...)``.  A request submitted while a step runs joins the next one.

Speed: requests that are decoding form a *decode group* kept in aggregate (a step counter, the
KV-token sum, a histogram of when each member next needs a block, a heap of finish steps), so a
step costs O(1) for all its decodes plus O(1) per prefill chunk; a member's own counters are
brought up to date only when it leaves the group (finish, abort, preemption).  Decode-only steps
(no prefill in progress, nobody admissible) run in a tight loop up to the next finish or ``now``,
and "tokens" updates are reported once per ``run_until`` per request (``new_tokens=k``).

Driving it: call ``run_until(t)`` before acting at time ``t``; it returns every update with
time <= t (``submit``/``abort`` advance to ``now`` themselves and keep what that produces for the
next ``run_until``).  A real-time driver sleeps until ``next_step_time()``.  A simulator that only
needs first tokens and finishes should pass ``emit_token_updates=False``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.replica.emulated.block_pool import BlockPool
from kvroute.replica.emulated.kv_events import KVEvent
from kvroute.replica.emulated.profile import TimingProfile

_WAITING, _RUNNING, _DONE = 0, 1, 2


@dataclass
class EngineRequest:
    request_id: str
    block_hashes: list[int]  # hashes of the prompt's full blocks (chained)
    prompt_tokens: int  # may exceed len(block_hashes)*block_size (partial last block)
    max_tokens: int  # output tokens to generate (>= 1)
    token_ids: Sequence[int] | None = None  # prompt token ids, only needed for KV events


@dataclass(slots=True)
class EngineUpdate:
    """Progress of one request.  Over a request's updates, ``new_tokens`` sums to the tokens it
    generated (``finished`` and ``aborted`` carry 0; they follow the tokens of the same step)."""

    request_id: str
    kind: str  # "first_token" | "tokens" | "finished" | "aborted"
    time: float  # when the step that produced it completed (abort: when it was aborted)
    new_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit of the request, tokens (first_token, finished, aborted)


class _Req:
    __slots__ = ("id", "hashes", "prompt", "max_tokens", "token_ids", "computed", "generated",
                 "blocks", "num_hashed", "cached_tokens", "state", "seq", "reported",
                 "tag", "join_step", "c_join", "g_join")

    def __init__(self, req: EngineRequest):
        self.id = req.request_id
        self.hashes = req.block_hashes
        self.prompt = req.prompt_tokens
        self.max_tokens = req.max_tokens
        self.token_ids = req.token_ids
        # Tokens whose KV is computed or being computed by the step in progress.  For a member of
        # the decode group, computed/generated are stale: see EmulatedEngine._leave.
        self.computed = 0
        self.generated = 0
        self.blocks: list[int] = []
        self.num_hashed = 0  # leading blocks registered in the prefix cache
        self.cached_tokens = -1  # prefix hit at first admission; -1 before
        self.state = _WAITING
        self.seq = 0  # admission order (running requests are served, and preempted, by it)
        self.reported = 0  # generated tokens already reported in updates
        self.tag = -1  # >= 0 while in the decode group (identifies its heap entry)
        self.join_step = self.c_join = self.g_join = 0


class _Step:
    __slots__ = ("start", "end", "items", "group", "events")

    def __init__(self, start: float, end: float, items: list[tuple[_Req, int]], group: bool,
                 events: list[KVEvent]):
        self.start = start
        self.end = end
        self.items = items  # (request outside the decode group, tokens scheduled)
        self.group = group  # the decode group takes part
        self.events = events  # KV events of its scheduling, delivered when it completes


class EmulatedEngine:
    def __init__(self, profile: TimingProfile, *, num_gpu_blocks: int | None = None,
                 block_size: int | None = None,
                 on_kv_event: Callable[[KVEvent], None] | None = None,
                 emit_token_updates: bool = True, max_coalesce: int | None = None):
        """``emit_token_updates``: report generated tokens as "tokens" updates (without them only
        first tokens, finishes and aborts are reported).  ``max_coalesce``: most decode-only steps
        run in one go (None: unbounded; 1: every step goes through the full scheduler)."""
        self.profile = profile
        self.block_size = block_size or profile.block_size
        self.num_gpu_blocks = num_gpu_blocks or profile.num_gpu_blocks
        self.max_num_seqs = profile.max_num_seqs
        self.max_num_batched_tokens = profile.max_num_batched_tokens
        self.emit_token_updates = emit_token_updates
        self.max_coalesce = max_coalesce
        self.pool = BlockPool(self.num_gpu_blocks, self.block_size)
        self.on_kv_event = on_kv_event
        self._requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._solo: list[_Req] = []  # running requests outside the decode group, by seq
        self._step: _Step | None = None
        self._clock = 0.0  # when the next step may start (no step in progress)
        self._now = 0.0  # latest time the caller told us about
        self._last_end = 0.0  # end of the latest completed step
        self._updates: list[EngineUpdate] = []
        self._seq = 0
        self._tags = 0
        # The decode group: members decode one token every group step.
        self._members: dict[_Req, None] = {}
        self._g_sched = 0  # group steps scheduled
        self._g_done = 0  # group steps completed (== _g_sched unless one is in progress)
        self._g_kv_base = 0  # KV tokens of the next group step = base + len(members) * _g_sched
        self._g_due = [0] * self.block_size  # members needing a block at steps s with s % bs == i
        self._g_heap: list[tuple[int, int, _Req]] = []  # (step completing it, tag, member)
        self._g_pool: list[int] = []  # blocks allocated to members, not yet handed to them
        self._tokens_pending = False
        # vLLM metric equivalents (tokens, cumulative)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0
        self.coalesced_steps = 0  # steps run by the decode-only fast path (for tests and tuning)

    @property
    def on_kv_event(self) -> Callable[[KVEvent], None] | None:
        return self._on_kv_event

    @on_kv_event.setter
    def on_kv_event(self, callback: Callable[[KVEvent], None] | None) -> None:
        self._on_kv_event = callback
        self.pool.record_events = callback is not None  # nobody listens: do not build events

    # --- observable state ----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._solo) + len(self._members)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.num_used / self.pool.usable  # as vLLM: the null block does not count

    @property
    def now(self) -> float:
        return self._now

    # --- driving -----------------------------------------------------------------------------
    def submit(self, req: EngineRequest, now: float) -> None:
        bs = self.block_size
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.max_tokens < 1 or req.prompt_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if len(req.block_hashes) > req.prompt_tokens // bs:
            raise ValueError("more block hashes than full prompt blocks")
        if -(-(req.prompt_tokens + req.max_tokens - 1) // bs) > self.pool.usable:
            raise ValueError(f"request needs more than the KV capacity ({self.pool.usable} usable blocks)")
        now = self._sync(now)
        if self._step is None and not self._requests:
            self._clock = now  # idle: the next step starts when work arrives
        r = _Req(req)
        self._requests[r.id] = r
        self._waiting.append(r)

    def abort(self, request_id: str, now: float) -> None:
        now = self._sync(now)
        r = self._requests.pop(request_id, None)
        if r is None:
            return
        if r.state == _WAITING:
            self._waiting.remove(r)
        else:  # a step in progress that holds it completes without it
            if r.tag >= 0:
                self._leave(r)
                self._report_tokens(r, self._last_end)
            else:
                self._solo.remove(r)
            self.pool.free(r.blocks[::-1])
            r.blocks = []
        r.state = _DONE
        self._updates.append(EngineUpdate(r.id, "aborted", now, 0, max(r.cached_tokens, 0)))

    def next_step_time(self) -> float | None:
        """When the step in progress completes; None when idle."""
        if self._step is None:
            if not self._requests:
                return None
            self._step = self._schedule(self._clock)
        return self._step.end

    def run_until(self, now: float) -> list[EngineUpdate]:
        """Run every step completing at or before ``now``; the updates since the last call."""
        self._sync(now)
        updates, self._updates = self._updates, []
        return updates

    def reset_prefix_cache(self) -> bool:
        """Like vLLM's: refused (False) while any block is in use; emits AllBlocksCleared."""
        if self._step is not None and self._step.events:  # deliver what precedes the reset
            self._deliver(self._step.events)
            self._step.events = []
        ok = self.pool.reset()
        self._deliver(self.pool.take_events())
        return ok

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        self.pool.check_invariants()
        bs = self.block_size
        holders = [0] * self.num_gpu_blocks
        running = [*self._solo, *self._members]
        for r in running:
            assert r.state == _RUNNING and self._requests[r.id] is r
            for b in r.blocks:
                holders[b] += 1
        for b in self._g_pool:
            holders[b] += 1
        assert holders == self.pool.ref_count, "block references do not match their holders"
        owed = 0
        for r in self._members:
            c = r.c_join + self._g_sched - r.join_step
            owed += -(-c // bs) - len(r.blocks)
            assert r.g_join + self._g_done - r.join_step < r.max_tokens
        assert owed == len(self._g_pool), "decode group block accounting"
        kv = sum(r.c_join + 1 - r.join_step for r in self._members)
        assert kv == self._g_kv_base
        for r in self._solo:
            assert -(-r.computed // bs) == len(r.blocks) and r.tag < 0
        for r in self._waiting:
            assert r.state == _WAITING and not r.blocks and r.computed == 0
        assert len(running) + len(self._waiting) == len(self._requests)
        assert len(running) <= self.max_num_seqs

    # --- stepping ----------------------------------------------------------------------------
    def _sync(self, now: float) -> float:
        """Run the steps that complete by ``now``; returns ``now`` (never earlier than before)."""
        before = self._now
        if now < before:
            now = before
        self._now = now
        while True:
            step = self._step
            if step is not None:
                if step.end > now:
                    break
                self._complete(step)
                continue
            # A step that would start exactly at `now` is not formed yet: work arriving at `now`
            # joins it.
            if not self._requests or self._clock >= now:
                break
            if self._decode_only() and self._run_decodes(now):
                continue
            self._step = self._schedule(self._clock)
        if self._tokens_pending:
            self._flush_tokens()
        if now == math.inf:  # ran to completion: the engine's time is its last step's end
            now = self._now = max(before, self._last_end)
        return now

    def _deliver(self, events: list[KVEvent]) -> None:
        cb = self._on_kv_event
        if cb is not None:
            for ev in events:
                cb(ev)

    def _schedule(self, t: float) -> _Step:
        """One vLLM-v1 scheduler pass at time ``t``."""
        bs = self.block_size
        pool = self.pool
        free = pool.free_queue_len
        budget = self.max_num_batched_tokens
        n_group = len(self._members)
        group_need = self._g_due[self._g_sched % bs] if n_group else 0
        if n_group and (n_group > budget or group_need + self._solo_need(budget - n_group) > free()):
            # Decodes that do not all fit the budget, or a preemption ahead: take the group apart
            # and run vLLM's loop request by request (the group re-forms as steps complete).
            self._dissolve()
            n_group = group_need = 0
        items: list[tuple[_Req, int]] = []
        prefill_tokens = decodes = kv_tokens = attn_pairs = 0
        if n_group:
            if group_need:
                self._g_pool += pool.allocate(group_need)
            decodes = n_group
            kv_tokens = self._g_kv_base + n_group * self._g_sched
            self._g_sched += 1
            budget -= n_group
        running = self._solo
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            c0 = r.computed
            left = r.prompt + r.generated - c0
            n = left if left < budget else budget
            while True:
                need = -(-(c0 + n) // bs) - len(r.blocks)
                if need <= free():
                    break
                victim = running.pop()  # the group is empty here: the latest admitted is last
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.state != _RUNNING:
                break
            if need > 0:
                r.blocks += pool.allocate(need)
            r.computed = c0 + n
            self._cache_full_blocks(r)
            items.append((r, n))
            budget -= n
            if left == 1 and r.generated:
                decodes += 1
                kv_tokens += c0 + 1
            else:
                prefill_tokens += n
                attn_pairs += n * c0 + n * (n + 1) // 2
            i += 1
        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) + n_group < self.max_num_seqs:
                r = waiting[0]
                num_tokens = r.prompt + r.generated
                hits = pool.longest_prefix(r.hashes, (num_tokens - 1) // bs)
                c0 = len(hits) * bs
                left = num_tokens - c0
                n = left if left < budget else budget
                need = -(-(c0 + n) // bs) - len(hits)
                if need + pool.num_unreferenced(hits) > free():
                    break
                waiting.popleft()
                pool.touch(hits)
                r.blocks = hits + pool.allocate(need)
                r.num_hashed = len(hits)
                r.computed = c0 + n
                r.state = _RUNNING
                self._seq += 1
                r.seq = self._seq
                if r.cached_tokens < 0:  # first admission: what vLLM's prefix-cache metrics count
                    r.cached_tokens = c0
                    self.prefix_cache_queries += r.prompt
                    self.prefix_cache_hits += c0
                self._cache_full_blocks(r)
                running.append(r)
                items.append((r, n))
                budget -= n
                prefill_tokens += n
                attn_pairs += n * c0 + n * (n + 1) // 2
        if not items and not n_group:  # submit() rejects requests that could never fit
            raise RuntimeError("work pending but nothing schedulable")
        end = t + self.profile.step_time(prefill_tokens, decodes, kv_tokens, attn_pairs)
        return _Step(t, end, items, n_group > 0, pool.take_events())

    def _solo_need(self, budget: int) -> int:
        """Blocks the running requests outside the group would take this step, in order."""
        bs = self.block_size
        total = 0
        for r in self._solo:
            if budget <= 0:
                break
            left = r.prompt + r.generated - r.computed
            n = left if left < budget else budget
            total += -(-(r.computed + n) // bs) - len(r.blocks)
            budget -= n
        return total

    def _cache_full_blocks(self, r: _Req) -> None:
        full = min(r.computed // self.block_size, len(r.hashes))
        if full > r.num_hashed:
            self.pool.cache(r.blocks, r.hashes, r.num_hashed, full, r.token_ids)
            r.num_hashed = full

    def _preempt(self, r: _Req) -> None:
        """vLLM's recompute preemption: drop its KV, back to the head of the queue."""
        self.pool.free(r.blocks[::-1])
        r.blocks = []
        r.computed = 0
        r.num_hashed = 0
        r.state = _WAITING
        self._waiting.appendleft(r)
        self.num_preemptions += 1

    def _complete(self, step: _Step) -> None:
        t = step.end
        self._clock = self._last_end = t
        self._step = None
        self._deliver(step.events)
        if step.group:
            self._g_done = self._g_sched
            self.generation_tokens_total += len(self._members)
            self._tokens_pending = True
            self._finish_members(t)
        updates = self._updates
        moved = False
        for r, _ in step.items:
            if r.state != _RUNNING or r.computed < r.prompt + r.generated:
                continue  # aborted meanwhile, or a prefill chunk that leaves more to compute
            r.generated += 1
            self.generation_tokens_total += 1
            moved = True
            if r.generated == 1:
                self.prompt_tokens_total += r.prompt
                r.reported = 1
                updates.append(EngineUpdate(r.id, "first_token", t, 1, r.cached_tokens))
            else:
                self._tokens_pending = True
            if r.generated >= r.max_tokens:
                self._finish(r, t)
            else:
                self._join(r)
        if moved:
            self._solo = [r for r in self._solo if r.state == _RUNNING and r.tag < 0]

    def _finish(self, r: _Req, t: float) -> None:
        self._report_tokens(r, t)
        self.pool.free(r.blocks[::-1])
        r.blocks = []
        r.state = _DONE
        del self._requests[r.id]
        self._updates.append(EngineUpdate(r.id, "finished", t, 0, r.cached_tokens))

    def _report_tokens(self, r: _Req, t: float) -> None:
        if self.emit_token_updates and r.generated > r.reported:
            self._updates.append(EngineUpdate(r.id, "tokens", t, r.generated - r.reported))
            r.reported = r.generated

    def _flush_tokens(self) -> None:
        """One "tokens" update per request with unreported tokens (the steps since the last)."""
        self._tokens_pending = False
        if not self.emit_token_updates:
            return
        t, done, updates = self._last_end, self._g_done, self._updates
        for r in self._members:
            g = r.g_join + done - r.join_step
            if g > r.reported:
                updates.append(EngineUpdate(r.id, "tokens", t, g - r.reported))
                r.reported = g

    # --- the decode group ----------------------------------------------------------------------
    def _join(self, r: _Req) -> None:
        """``r`` has just sampled a token and is not finished: it decodes from now on."""
        s = self._g_sched
        r.join_step, r.c_join, r.g_join = s, r.computed, r.generated
        # Its next token lands at position c_join + (step - s); a new block is needed whenever that
        # position starts one.
        self._g_due[(s - r.computed) % self.block_size] += 1
        self._g_kv_base += r.computed + 1 - s
        self._tags += 1
        r.tag = self._tags
        heapq.heappush(self._g_heap, (s + r.max_tokens - r.generated, r.tag, r))
        self._members[r] = None

    def _leave(self, r: _Req) -> None:
        """Take ``r`` out of the group, bringing its counters and blocks up to date."""
        s = r.join_step
        c = r.computed = r.c_join + self._g_sched - s
        r.generated = r.g_join + self._g_done - s
        need = -(-c // self.block_size) - len(r.blocks)
        if need > 0:  # which of the group's blocks does not matter: none of them is hashed
            pool = self._g_pool
            r.blocks += pool[-need:]
            del pool[-need:]
        self._g_due[(s - r.c_join) % self.block_size] -= 1
        self._g_kv_base -= r.c_join + 1 - s
        r.tag = -1
        del self._members[r]

    def _finish_members(self, t: float) -> None:
        heap, done = self._g_heap, self._g_done
        while heap and heap[0][0] <= done:
            _, tag, r = heapq.heappop(heap)
            if r.tag == tag:  # else it left the group earlier
                self._leave(r)
                self._finish(r, t)

    def _dissolve(self) -> None:
        members = list(self._members)
        for r in members:
            self._leave(r)
        assert not self._g_pool, "decode group block accounting"
        self._g_heap.clear()
        self._solo = sorted(self._solo + members, key=lambda r: r.seq)

    def _decode_only(self) -> bool:
        """Whether the next steps are decode-only steps of the group: nothing else is running and
        nobody waiting can be admitted.  While they run, nothing makes an admission possible: the
        free blocks only shrink and the running count stays until a finish."""
        limit = self.max_coalesce
        n = len(self._members)
        if self._solo or not n or (limit is not None and limit < 2):
            return False
        budget = self.max_num_batched_tokens - n
        if budget < 0:
            return False
        waiting = self._waiting
        return not (waiting and budget > 0 and n < self.max_num_seqs
                    and self._admissible(waiting[0], budget))

    def _admissible(self, r: _Req, budget: int) -> bool:
        """Whether the scheduler would admit waiting request ``r`` now (no side effects)."""
        bs = self.block_size
        pool = self.pool
        num_tokens = r.prompt + r.generated
        hits = pool.longest_prefix(r.hashes, (num_tokens - 1) // bs)
        c0 = len(hits) * bs
        n = min(num_tokens - c0, budget)
        need = -(-(c0 + n) // bs) - len(hits)
        return need + pool.num_unreferenced(hits) <= pool.num_free

    def _run_decodes(self, now: float) -> bool:
        """Run decode-only group steps from the clock: those ending by ``now`` at once, up to the
        next finish; the one still running at ``now`` becomes the step in progress.  False if no
        step could run this way (a block shortage: the scheduler must preempt)."""
        bs, n = self.block_size, len(self._members)
        pool, due, step_time = self.pool, self._g_due, self.profile.step_time
        free = pool.free_queue_len
        heap = self._g_heap
        while heap[0][1] != heap[0][2].tag:  # drop entries of members that left
            heapq.heappop(heap)
        next_finish = heap[0][0]
        limit = self.max_coalesce if self.max_coalesce is not None else next_finish
        s, base, t = self._g_sched, self._g_kv_base, self._clock
        start_s = s
        while True:
            need = due[s % bs]
            if need > free():
                break
            if need:
                self._g_pool += pool.allocate(need)
            end = t + step_time(0, n, base + n * s)
            s += 1
            if end > now:  # in progress at `now`
                self._step = _Step(t, end, [], True, [])
                break
            t = end
            if s >= next_finish or s - start_s >= limit:
                break
        self._g_sched = s
        done = s - start_s - (self._step is not None)
        if done:
            self.coalesced_steps += done
            self._g_done = start_s + done
            self._clock = self._last_end = t
            self.generation_tokens_total += n * done
            self._tokens_pending = True
            self._finish_members(t)
        self._deliver(pool.take_events())
        return done > 0 or self._step is not None
