"""kvroute's own policy: the placement that costs the fleet least, under bounded loads (docs/design.md §5.7).

For each eligible replica r holding m_r leading blocks of a P-token prompt:

    uncached_r = P - m_r * block_size
    cost_r     = (queued_prefill_tokens_r + own_work_weight * (1 + behind) * uncached_r
                  + decode_weight * decoding_r * steps_r) / prefill_rate

- ``behind`` prices a copy: a fresh prefill also delays the requests that will queue behind it,
  rho / (1 - rho) of them, 3 (``queued_behind``) at the 75% utilisation a fleet is run at.  So a
  request leaves the replica holding its prefix only when that replica's queue costs more than the
  fleet pays for a second copy.  ``behind`` is 0 (this request's TTFT alone) when the best holder
  has less than half the prompt (explore, as Preble's E2), and for a hot prefix: one whose share of
  recent requests (decayed over ``signal_tau_s``, ``prefix_heat.py``) exceeds its holders' fair
  share (holders / n), so copies are built as its holders queue.
- ``decoding_r`` running sequences (the larger of the router's in-flight count and the scraped
  ``num_requests_running``) each cost ``decode_weight`` prompt-token equivalents in each of the
  ``steps_r = 1 + work_r // step_token_budget`` engine steps before the first token: its share of
  the dense layers (about 1.4 prompt tokens for an 8B model) plus reading its KV context (about 2
  per 1k context tokens on an H100-class part): 4 for a 1-2k context.  A tie-breaker next to a
  cache hit.
- ``prefill_rate`` is the median of the eligible replicas' learned rates (unknown ones count as
  ``default_prefill_rate``): short prefills' TTFTs are mostly engine step time, so identical
  replicas learn rates tens of percent apart.  ``per_replica_rates=True`` for unlike hardware.
- A slow replica, whose learned rate is below the median by more than the noise of identical
  replicas, has its cost multiplied by ``slowness`` = median / rate - ``slow_margin`` (1 when that
  is under 1), fading over ``slow_memory_s`` once it takes no rate samples; for a request with a
  session key every replica's cost also carries the session's expected turns left times a turn's
  own work times ``slowness - 1``, so sessions leave it (rule 5).
- Evicting what later requests would hit is not priced.

The choice:
1. Bounded loads: a replica qualifies if ``in_flight + 1 <= max(ceil((1 + epsilon) *
   (total_in_flight + 1) / n), bound_floor)``; the least loaded always does.  When the best holder
   holds at least ``keep_tokens`` of the prompt, every replica holding that much qualifies whatever
   its in-flight count (moving it would recompute at least a full engine step of prefill).
2. New sessions (a session key never seen, or forgotten) go first to qualifying replicas short of
   active sessions (fewer than mean / (1 + session_epsilon): one back from a restart holds none),
   else to those within ``ceil((1 + session_epsilon) * (total_active + 1) / n)``, else to any
   qualifying one.  A session is active for ``session_idle_s`` after its last request; its later
   turns follow it.  A slow replica is never short, and its sessions count ``slowness`` times.
3. Argmin of the cost over the qualifying replicas; ties to fewer requests in flight, then rotate.
4. Starvation: a qualifying replica not chosen in the last ``starve_window * n`` decisions, while
   the bound is past ``bound_floor``, gets the next request (it builds the hot prefix there); a
   slow replica is left alone.
5. A slow replica (its learned rate below the median beyond noise: ``slowness``) costs its
   slowness on this turn and, for a session, on the turns it is expected to have left; the verdict
   fades once it takes no samples, so traffic probes it again.
6. Session hint: the session's last replica keeps it while within the in-flight bound and its cost
   is within ``session_ratio * best + session_slack_s`` (the index may not have learnt yet what it
   holds).  At most ``max_sessions`` are remembered (LRU).

``greedy_ttft`` is this policy with ``behind`` = 0, epsilon = 1, session_epsilon = 0 and no
``keep_tokens``: this request's TTFT alone, the default until the fleet was priced.

Reasons: "cache" (the argmin holds a prefix), "load" (the argmin holds none: least work),
"balance" (a bound or the starvation rule overrode the unconstrained argmin), "session" (the
hint changed the choice).

The simulator runs that earned each rule and constant, and what was tried and not kept:
docs/experiments.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query
from kvroute.router.placement.policy.prefix_heat import PrefixHeat
from kvroute.router.placement.policy.sessions import SessionBook

EPSILON = 2.0
BOUND_FLOOR = 4
SESSION_EPSILON = 1.0
SESSION_IDLE_S = 120.0
OWN_WORK_WEIGHT = 1.0
DECODE_WEIGHT = 4.0
STEP_TOKEN_BUDGET = 8192  # vLLM's default max_num_batched_tokens for the OpenAI server on big GPUs
KEEP_TOKENS = STEP_TOKEN_BUDGET  # a held prefix worth a full engine step of prefill is not moved for the bound
STARVE_WINDOW = 8.0
SESSION_RATIO = 1.25
SESSION_SLACK_S = 0.05
MAX_SESSIONS = 100_000
QUEUED_BEHIND = 3.0  # rho / (1 - rho) at rho = 0.75
SLOW_MARGIN = 0.5  # a replica counts as slow by (median rate / its rate) - this, when above 1
SLOW_MEMORY_S = 60.0  # a slow verdict fades over this time constant once its replica takes no samples
SLOW_FADED = 0.05  # below this excess a fading verdict is gone: the replica takes sessions again
SIGNAL_TAU_S = 30.0
MAX_PREFIX_KEYS = 100_000


class CostModelPolicy(Policy):
    name = "cost_model"
    reasons = ("cache", "load", "balance", "session")

    def __init__(
        self,
        *,
        epsilon: float = EPSILON,
        bound_floor: int = BOUND_FLOOR,
        session_epsilon: float | None = SESSION_EPSILON,
        session_idle_s: float = SESSION_IDLE_S,
        own_work_weight: float = OWN_WORK_WEIGHT,
        decode_weight: float = DECODE_WEIGHT,
        step_token_budget: int = STEP_TOKEN_BUDGET,
        default_prefill_rate: float | None = None,
        per_replica_rates: bool = False,
        starve_window: float = STARVE_WINDOW,
        session_ratio: float = SESSION_RATIO,
        session_slack_s: float = SESSION_SLACK_S,
        max_sessions: int = MAX_SESSIONS,
        queued_behind: float = QUEUED_BEHIND,
        signal_tau_s: float = SIGNAL_TAU_S,
        explore: bool = True,
        keep_tokens: int | None = KEEP_TOKENS,
        slow_margin: float | None = SLOW_MARGIN,
        slow_memory_s: float = SLOW_MEMORY_S,
        seed: int = 0,
    ):
        """Tunables (defaults in the module constants; why: docs/design.md §5.7, docs/experiments.md):

        epsilon: in-flight bound, (1 + epsilon) x the mean (2.0).
        bound_floor: in-flight count a replica may always reach (4).
        session_epsilon: active-session bounds for placing new sessions (1.0: at most twice the
            mean, replicas under half of it first); None disables the rule.
        session_idle_s: a session stays active this long after its last request (120 s).
        own_work_weight: weight of the request's own uncached prefill against queued work (1.0).
        queued_behind: requests expected to queue behind a placement's prefill (3.0); 0 prices
            this request's TTFT alone.
        signal_tau_s: time constant of the prefix traffic shares (30 s).
        explore: no fleet price for a request whose best holder has less than half of it (True).
        keep_tokens: a replica holding the longest cached prefix, if that is at least this many
            tokens, may take the request past the in-flight bound (8192, one engine step's
            budget); None applies the bound to every request.
        decode_weight: prompt-token cost of one running sequence per engine step (4.0).
        step_token_budget: tokens per engine step, vLLM's max_num_batched_tokens (8192).
        default_prefill_rate: tokens/s for replicas with no learned rate (None: the
            LoadTracker's prior, kvroute.router.placement.load.DEFAULT_PREFILL_RATE).
        per_replica_rates: each replica's own learned rate instead of the median (False).
        slow_margin: a replica whose learned rate is below the median by more than noise is
            slow: its work costs (median / its rate) - slow_margin times more, on this turn and
            on the turns its session is expected to have left (0.5); None: no replica is slow.
        slow_memory_s: a slow verdict fades with this time constant while its replica takes no
            rate samples, so that traffic probes it again (60 s).
        starve_window: decisions, in multiples of the fleet size, after which an unchosen
            replica gets the next request (8); 0 disables the rule.
        session_ratio, session_slack_s: how much worse than the best a session's replica may be
            estimated and still keep the session (1.25 x + 50 ms).
        max_sessions: session -> replica entries remembered (LRU, 100k).
        seed: accepted for a uniform constructor; the policy is deterministic.
        """
        if default_prefill_rate is None:
            # Imported here: kvroute.router.placement.load imports this package (for ReplicaState) at its top.
            from kvroute.router.placement.load import DEFAULT_PREFILL_RATE

            default_prefill_rate = DEFAULT_PREFILL_RATE
        if epsilon < 0 or (session_epsilon is not None and session_epsilon < 0):
            raise ValueError("epsilon and session_epsilon must be >= 0")
        if step_token_budget <= 0 or default_prefill_rate <= 0 or max_sessions <= 0:
            raise ValueError("step_token_budget, default_prefill_rate, max_sessions must be > 0")
        self.epsilon = epsilon
        self.bound_floor = bound_floor
        self.session_epsilon = session_epsilon
        self.own_work_weight = own_work_weight
        self.decode_weight = decode_weight
        self.step_token_budget = step_token_budget
        self.default_prefill_rate = default_prefill_rate
        self.per_replica_rates = per_replica_rates
        self.starve_window = starve_window
        self.session_ratio = session_ratio
        self.session_slack_s = session_slack_s
        self.sessions = SessionBook(max_sessions, session_idle_s)
        self.queued_behind = queued_behind
        self.explore = explore
        self.keep_tokens = keep_tokens
        self.slow_margin = slow_margin
        self.slow_memory_s = slow_memory_s
        self.heat = PrefixHeat(signal_tau_s, MAX_PREFIX_KEYS)
        self._decisions = 0
        self._last_pick: dict[str, int] = {}  # replica -> decision number of its last pick

    # -- the estimate --------------------------------------------------------------------------
    def matched_blocks(self, req: Query, replica: str) -> int:
        return min(req.matches.get(replica, 0), len(req.chain))

    def rate_of(self, r: ReplicaState) -> float:
        return r.prefill_rate if r.prefill_rate > 0 else self.default_prefill_rate

    def slowness(self, r: ReplicaState, pooled: float, now: float) -> float:
        """How many times slower than the fleet ``r`` serves (1: not slow).  Identical replicas'
        learned rates differ by tens of percent (short prefills are mostly step overhead), so only
        a shortfall beyond ``slow_margin`` counts; it fades once ``r`` takes no samples (the
        next one after ``RATE_STALE_S`` replaces the stale rate: router/placement/load.py)."""
        if self.slow_margin is None:
            return 1.0
        excess = pooled / self.rate_of(r) - self.slow_margin - 1.0
        if excess <= 0.0:
            return 1.0
        excess *= math.exp(-max(0.0, now - r.rate_sampled_at) / self.slow_memory_s)
        return 1.0 + excess if excess >= SLOW_FADED else 1.0

    def est_ttft(self, req: Query, r: ReplicaState, rate: float | None = None, behind: float = 0.0) -> float:
        """Estimated cost in seconds of sending ``req`` to ``r`` (``rate``: that replica's own if
        None): its wait and own prefill, plus the delay its prefill causes the ``behind``
        requests expected to queue after it."""
        uncached = max(0, req.prompt_tokens - self.matched_blocks(req, r.name) * req.block_size)
        queued = r.queued_prefill_tokens
        steps = 1 + (queued + uncached) // self.step_token_budget
        decoding = max(r.in_flight, r.running)
        weight = self.own_work_weight * (1.0 + behind)
        work = queued + weight * uncached + self.decode_weight * decoding * steps
        return work / (self.rate_of(r) if rate is None else rate)

    def behind(self, req: Query, replicas: Sequence[ReplicaState]) -> float:
        """Requests expected to queue behind this one's prefill, as the fleet's price of a copy;
        0 (no price) when the best holder has less than half the prompt (explore), and for a hot
        prefix, whose traffic is more than its holders serve at a fair share each."""
        heat = self.heat
        held = min(max(req.matches.values(), default=0), len(req.chain))
        key = req.chain[held - 1] if held > 0 else None
        heat.record(key, req.now)
        if self.explore and 2 * held * req.block_size < req.prompt_tokens:
            return 0.0
        if key is not None:
            holders = sum(1 for r in replicas if min(req.matches.get(r.name, 0), len(req.chain)) >= held)
            if heat.share(key, req.now) * len(replicas) > holders:
                return 0.0
        return self.queued_behind

    def load_bound(self, replicas: Sequence[ReplicaState]) -> int:
        total = sum(r.in_flight for r in replicas)
        mean_with_new = (total + 1) / len(replicas)
        return max(math.ceil((1 + self.epsilon) * mean_with_new - 1e-9), self.bound_floor)

    def session_bounds(self, replicas: Sequence[ReplicaState], epsilon: float) -> tuple[float, int]:
        """(floor, bound) on active sessions: below the floor a replica is short of sessions,
        above the bound it may take no new one."""
        total = sum(self.sessions.active(r.name) for r in replicas)
        mean = total / len(replicas)
        return mean / (1 + epsilon), math.ceil((1 + epsilon) * (total + 1) / len(replicas) - 1e-9)

    # -- the choice ----------------------------------------------------------------------------
    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        n = len(replicas)
        turn = self._decisions
        self._decisions += 1
        key = req.session_key
        if key is not None:
            self.sessions.expire(req.now)
        behind = self.behind(req, replicas)
        if n == 1:
            only = replicas[0].name
            return self._decided(req, only, "cache" if self.matched_blocks(req, only) else "load")

        slow = [1.0] * n
        if self.per_replica_rates:
            cost = [self.est_ttft(req, r, behind=behind) for r in replicas]
        else:
            pooled = statistics.median(self.rate_of(r) for r in replicas)
            slow = [self.slowness(r, pooled, req.now) for r in replicas]
            cost = [self.est_ttft(req, r, pooled / f, behind) for r, f in zip(replicas, slow)]
            if key is not None and max(slow) > 1.0:
                # a session placed on a slow replica is slow on every turn it has left: staying
                # must beat moving over those turns, not this one alone
                held_any = min(max(req.matches.values(), default=0), len(req.chain))
                turn_work = self.own_work_weight * (1.0 + behind) * max(req.block_size, req.prompt_tokens - held_any * req.block_size)
                left = self.sessions.turns_left(self.sessions.turns(key))
                cost = [c + left * turn_work * (f - 1.0) / pooled for c, f in zip(cost, slow)]

        def rank(i: int) -> tuple[float, int, int]:
            return (cost[i], replicas[i].in_flight, (i - turn) % n)

        bound = self.load_bound(replicas)
        held = min(max(req.matches.values(), default=0), len(req.chain))
        keep = self.keep_tokens is not None and held > 0 and held * req.block_size >= self.keep_tokens
        allowed = [
            i
            for i, r in enumerate(replicas)
            if r.in_flight + 1 <= bound or (keep and self.matched_blocks(req, r.name) >= held)
        ]
        home = self.sessions.home(key) if key is not None else None
        if key is not None and home is None and self.session_epsilon is not None:
            # A new session: its later turns follow it, so it goes where sessions are few: to a
            # replica short of them if any (one back from a restart), never over the bound.  A
            # slow replica's sessions count as many times as it is slow, and it is never short.
            floor, limit = self.session_bounds(replicas, self.session_epsilon)
            active = [self.sessions.active(replicas[i].name) for i in allowed]
            short = [i for i, a in zip(allowed, active) if a < floor and slow[i] == 1.0]
            allowed = short or [i for i, a in zip(allowed, active) if (a + 1) * slow[i] <= limit] or allowed
        if self.starve_window > 0 and bound > self.bound_floor:
            # a slow replica is left alone on purpose: its verdict fades, and traffic probes it
            horizon = turn - self.starve_window * n
            last = self._last_pick
            starved = [i for i in allowed if last.setdefault(replicas[i].name, turn) < horizon and slow[i] == 1.0]
            allowed = starved or allowed

        best_any = min(range(n), key=rank)
        best = min(allowed, key=rank)
        name = replicas[best].name
        if best != best_any:
            reason = "balance"
        else:
            reason = "cache" if self.matched_blocks(req, name) else "load"

        if home is not None and home != name:
            h = next((i for i, r in enumerate(replicas) if r.name == home), None)
            if (
                h is not None
                and replicas[h].in_flight + 1 <= bound
                and cost[h] <= cost[best] * self.session_ratio + self.session_slack_s
            ):
                name, reason = home, "session"
        return self._decided(req, name, reason)

    def _decided(self, req: Query, name: str, reason: str) -> Choice:
        self._last_pick[name] = self._decisions - 1  # this decision's number
        if req.session_key is not None:
            self.sessions.touch(req.session_key, name, req.now)
        return Choice(name, reason, self.matched_blocks(req, name))

    def session_replica(self, session: str) -> str | None:
        return self.sessions.home(session)

    def on_routed(self, req: Query, decision: Choice) -> None:
        # A retry may have sent the request elsewhere: the session now lives where it really went.
        if req.session_key is not None and self.sessions.home(req.session_key) != decision.replica:
            self.sessions.touch(req.session_key, decision.replica, req.now)

    def forget_replica(self, replica: str) -> None:
        self.sessions.forget_replica(replica)
        self._last_pick.pop(replica, None)
