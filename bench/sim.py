"""Fleet simulator: the real routing code against N emulated engines, in virtual time (docs/design.md §1).

Per request the router side runs exactly what the router service runs: block-chain hashing
(`kvroute.common.blocks`), one prefix-index lookup (`MemoryIndex` on a virtual clock), the policy's
`choose`/`on_routed`, the index prediction, `LoadTracker` accounting, and after the answer the
same `first_token` / `finished` steps (`Placement`, `router/placement/sequence.py`); the engines
(`kvroute.replica.emulated.engine.EmulatedEngine`) model vLLM's prefix cache and step timing.  Engines'
KV events (BlockStored / BlockRemoved / AllBlocksCleared) feed the index as the router's event
subscriber would, with no delivery delay.

Time advances in windows.  Between two routing decisions the engines evolve independently, so
each engine is run up to the next arrival in one `run_until` call (which lets it coalesce decode
steps).  Closed-loop workloads release a request a think time after another one finishes; the
smallest think time bounds how far ahead the engines may run before such a release could be
missed, so the window is at most that.  Updates of one window are processed in time order.

Scraped replica metrics (running, waiting, KV usage) are read from the engines at decision time:
fresher than a real router's periodic scrape.

Figures (`summarize`): the three reuse figures share one denominator, the prompt tokens of the
requests sent, counted in full blocks.  `reuse_available` replays the requests in the order they
were routed through one infinite shared cache (leading blocks seen before, uncapped);
`reuse_predicted` sums the policy's `Choice.matched_blocks`; `reuse_delivered` the engines'
`cached_tokens`.  `limit_ttft` is the physical limit of each request's TTFT (bench/limit.py), from the
same arrival order as `reuse_available`.  `imbalance` is max/mean requests per replica, `throughput_rps` completed
requests over the span from the first arrival to the last finish.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.common.blocks import block_hashes, namespace_seed
from kvroute.router.index.base import ReplicaSpec
from kvroute.router.index.client import IndexClient
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.placement.load import LoadTracker
from kvroute.router.placement.sequence import Placement, snapshot
from kvroute.router.placement.policy.base import Policy, Query

from kvroute.bench.limit import available_blocks, limit_ttfts, prefill_seconds
from kvroute.bench.workloads import Workload, text_proxy

SIM_MODEL = "sim-model"  # the namespace of every chain in the simulator
METRIC_KEYS = (
    "reuse_available",
    "reuse_predicted",
    "reuse_delivered",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "imbalance",
    "throughput_rps",
    "requests",
)


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never really awaits (the memory index) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("index coroutine suspended: the simulator needs a non-blocking index")


# --- the workload, hashed once for all policies -----------------------------------------------


@dataclass
class PreparedWorkload:
    workload: Workload
    block_size: int
    chains: list[np.ndarray]  # per request: uint64 block hashes (full blocks)
    prompt_tokens: np.ndarray  # per request


def prepare(workload: Workload, block_size: int, model: str = SIM_MODEL) -> PreparedWorkload:
    seed = namespace_seed(model)
    chains: list[np.ndarray] = []
    prompt = np.empty(len(workload.requests), dtype=np.int64)
    for i, req in enumerate(workload.requests):
        tokens = req.tokens()
        prompt[i] = len(tokens)
        chains.append(np.array(block_hashes(tokens, block_size, seed), dtype=np.uint64))
    return PreparedWorkload(workload, block_size, chains, prompt)


# --- the default offered load -----------------------------------------------------------------


@dataclass
class OfferedLoad:
    rate: float  # req/s
    load: float  # fraction of the fleet's capacity
    miss_fraction: float  # expected uncached share of prompt tokens under round-robin
    prefill_share: float  # share of the per-request engine work spent in prefill
    mean_prompt_tokens: float

    def describe(self, replicas: int) -> str:
        return (
            f"rate {self.rate:.2f} req/s ≈ {self.load:.0%} of fleet prefill capacity under round_robin "
            f"({replicas} replicas; {self.miss_fraction:.0%} of {self.mean_prompt_tokens:,.0f} mean prompt "
            f"tokens uncached; decode work at full batch counted too: {1 - self.prefill_share:.0%} of the total)"
        )


def round_robin_hits(prepared: PreparedWorkload, replicas: int, capacity_blocks: int, seed: int = 0) -> np.ndarray:
    """Per request, the prefix-cache hit (tokens) it would get if spread the way round-robin does.

    With many interleaved clients, round-robin's choice is independent of a request's
    predecessors, so a seeded uniform draw stands in for it.  Each replica's cache is an LRU of
    `capacity_blocks` blocks, touched tail first as the engine frees a finished request's blocks
    (so a chain's head outlives its tail); requests that are running at once do not pin their
    blocks here, which is the only thing the engine adds.
    """
    rng = np.random.default_rng(seed)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    bs = prepared.block_size
    hits = np.zeros(len(prepared.chains), dtype=np.int64)
    picks = rng.integers(0, replicas, len(prepared.chains))
    for i, (chain, prompt, r) in enumerate(zip(prepared.chains, prepared.prompt_tokens.tolist(), picks.tolist())):
        cache = caches[r]
        hashes = chain.tolist()
        m = 0
        for h in hashes:
            if h not in cache:
                break
            m += 1
        if m * bs >= prompt:  # vLLM computes at least one token
            m -= 1
        hits[i] = m * bs
        touch = cache.move_to_end
        for h in reversed(hashes):
            if h in cache:
                touch(h)
            else:
                cache[h] = None
        for _ in range(len(cache) - capacity_blocks):
            cache.popitem(last=False)
    return hits


def offered_load_rate(prepared: PreparedWorkload, profile: Any, replicas: int, load: float = 0.75, seed: int = 0) -> OfferedLoad:
    """The request rate that keeps `load` of the fleet busy under round-robin.

    Engine seconds per request = its prefill under round-robin (uncached tokens from
    `round_robin_hits`, timed by the profile's step time), plus its output tokens at the
    per-token cost of a full decode batch (as many sequences as the KV cache holds, counting
    only each one's unshared blocks, at most max_num_seqs).  The decode term matters where prefill is
    cheap (a hot shared document): a prefill-only rate would drown the fleet in decodes.
    """
    prompts = prepared.prompt_tokens
    hits = round_robin_hits(prepared, replicas, profile.num_gpu_blocks * profile.block_size // prepared.block_size, seed)
    uncached = prompts - hits
    prefill_s = float(np.mean([prefill_seconds(profile, u, c) for u, c in zip(uncached.tolist(), hits.tolist())]))
    mean_prompt = float(prompts.mean())
    mean_out = float(np.mean([r.max_tokens for r in prepared.workload.requests]))
    context = mean_prompt + mean_out / 2  # what a decoding sequence attends to, on average
    own = float(uncached.mean()) + mean_out / 2  # its KV not shared with others (cached prefixes are)
    batch = max(1, min(profile.max_num_seqs, int(profile.num_gpu_blocks * profile.block_size // max(own, 1))))
    decode_s = mean_out * profile.step_time(0, batch, int(batch * context)) / batch
    per_request = prefill_s + decode_s
    rate = load * replicas / per_request
    miss = float(uncached.sum() / prompts.sum()) if prompts.sum() else 1.0
    return OfferedLoad(rate, load, miss, prefill_s / per_request, mean_prompt)


# --- one policy's run -------------------------------------------------------------------------


TIME_FIELDS = ("step_base_s", "weights_read_s", "prefill_s_per_token", "decode_s_per_seq", "decode_s_per_kv_token",
               "prefill_s_per_attn_pair")


def slowed(profile: Any, factor: float) -> Any:
    """The profile with every step taking ``factor`` times as long: an emulated replica whose
    ``time_scale`` is ``factor`` times the others' (a slower GPU, a throttled or shared one)."""
    if factor == 1.0:
        return profile
    return profile.replace(**{f: getattr(profile, f) * factor for f in TIME_FIELDS})


@dataclass
class FleetConfig:
    replicas: int
    profile: Any  # kvroute.replica.emulated.profile.TimingProfile
    kv_events: bool = True  # engines publish KV events and the index consumes them
    predicted_ttl_s: float = 30.0  # MemoryIndex's default: predictions await KV events that long
    # Per replica, how many times slower than the profile it runs (empty: all at the profile's speed;
    # shorter than the fleet: the rest at 1).  The limit stays the profile's: an idle fast replica.
    slowdown: tuple[float, ...] = ()

    def replica_names(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.replicas)]

    def replica_profile(self, i: int) -> Any:
        return slowed(self.profile, self.slowdown[i] if i < len(self.slowdown) else 1.0)


@dataclass
class RunResult:
    policy: str
    replicas: list[str]
    block_size: int
    arrival: np.ndarray
    first_token: np.ndarray  # NaN if never
    finish: np.ndarray  # NaN if never
    replica: np.ndarray  # index into `replicas`, -1 if never routed
    predicted_blocks: np.ndarray  # what the policy believed the chosen replica held
    index_blocks: np.ndarray  # what the index said the chosen replica held
    cached_tokens: np.ndarray  # what the engine's prefix cache delivered
    available: np.ndarray  # leading blocks an infinite shared cache would have held
    full_blocks: np.ndarray
    prompt_tokens: np.ndarray
    reasons: dict[str, int] = field(default_factory=dict)
    too_long: int = 0  # requests not sent: larger than a replica's KV capacity
    # The physical limit (bench/limit.py) per request, in this run's arrival order; NaN if not sent.
    limit_ttft: np.ndarray = field(default_factory=lambda: np.empty(0))

    @property
    def ttft(self) -> np.ndarray:
        done = ~np.isnan(self.first_token)
        return self.first_token[done] - self.arrival[done]

    def metrics(self) -> dict[str, float | int]:
        return summarize(self)


def summarize(run: RunResult) -> dict[str, float | int]:
    """The eight figures of a run (reuse as fractions of the prompt tokens in full blocks)."""
    done = ~np.isnan(run.finish)
    routed = run.replica >= 0  # closed loop: turns released after the window are never sent
    denom = float(run.full_blocks[routed].sum() * run.block_size) or 1.0
    ttft = run.ttft
    counts = np.bincount(run.replica[routed], minlength=len(run.replicas))
    mean = counts.mean() if counts.size else 0.0
    span = float(np.nanmax(run.finish) - np.nanmin(run.arrival)) if done.any() else 0.0
    return {
        "reuse_available": float(run.available.sum() * run.block_size / denom),
        "reuse_predicted": float(run.predicted_blocks.sum() * run.block_size / denom),
        "reuse_delivered": float(run.cached_tokens.sum() / denom),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else math.nan,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft.size else math.nan,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else math.nan,
        "imbalance": float(counts.max() / mean) if mean > 0 else math.nan,
        "throughput_rps": float(done.sum() / span) if span > 0 else math.nan,
        "requests": int(done.sum()),
    }


class FleetSim:
    """One policy against a fresh fleet of cold engines and a fresh index."""

    def __init__(self, prepared: PreparedWorkload, policy: Policy, cfg: FleetConfig):
        from kvroute.replica.emulated.engine import EmulatedEngine, EngineRequest

        self._EngineRequest = EngineRequest
        self.prepared = prepared
        self.requests = prepared.workload.requests
        self.policy = policy
        self.cfg = cfg
        self.block_size = prepared.block_size
        self.now = 0.0
        self.names = cfg.replica_names()
        self.index = MemoryIndex(predicted_ttl_s=cfg.predicted_ttl_s, clock=lambda: self.now)
        self.tracker = LoadTracker()
        self._kv: list[tuple[str, Any]] = []
        self.engines = []
        for pos, name in enumerate(self.names):
            hook = (lambda ev, _n=name: self._kv.append((_n, ev))) if cfg.kv_events else None
            # Only first tokens and finishes matter to the router: no per-token updates.
            engine = EmulatedEngine(cfg.replica_profile(pos), block_size=self.block_size, on_kv_event=hook,
                                    emit_token_updates=False)
            self.engines.append(engine)
            drive(self.index.add_replica(ReplicaSpec(name, engine.num_gpu_blocks, publishes_events=cfg.kv_events)))
        self.placement = Placement(policy, IndexClient(self.index), self.tracker)  # in process: sync calls
        self._replica_pos = {n: i for i, n in enumerate(self.names)}
        n = len(self.requests)
        self._order: list[int] = []  # request indices in the order they were routed
        self.run = RunResult(
            policy=getattr(policy, "name", type(policy).__name__),
            replicas=self.names,
            block_size=self.block_size,
            arrival=np.full(n, np.nan),
            first_token=np.full(n, np.nan),
            finish=np.full(n, np.nan),
            replica=np.full(n, -1, dtype=np.int64),
            predicted_blocks=np.zeros(n, dtype=np.int64),
            index_blocks=np.zeros(n, dtype=np.int64),
            cached_tokens=np.zeros(n, dtype=np.int64),
            available=np.zeros(n, dtype=np.int64),
            full_blocks=np.fromiter((len(c) for c in prepared.chains), dtype=np.int64, count=n),
            prompt_tokens=prepared.prompt_tokens.copy(),
        )
        self._sent_at = np.full(n, np.nan)  # when the router sent each request (the arrival, unless held)
        self._dependents: dict[int, list[int]] = {}
        self._arrivals: list[tuple[float, int]] = []
        # A prompt (plus its output) larger than a replica's whole KV cache would be refused by
        # vLLM (max_model_len): it is not sent, nor anything that waits for it.
        capacity = min(e.num_gpu_blocks for e in self.engines)
        fits = -(-(prepared.prompt_tokens + np.array([r.max_tokens for r in self.requests], dtype=np.int64) - 1) // self.block_size) <= capacity
        self.run.too_long = int(n - fits.sum())
        for req in self.requests:
            if not fits[req.index]:
                continue
            if req.after is not None:
                self._dependents.setdefault(req.after, []).append(req.index)
            elif req.arrival_s is not None:
                self._arrivals.append((req.arrival_s, req.index))
        heapq.heapify(self._arrivals)
        self.window = prepared.workload.min_think_s
        end = prepared.workload.end_s
        self._end = math.inf if end is None else end

    # -- router side ------------------------------------------------------------------------
    # Hooks for a router that does not place every request on arrival (bench/late_binding.py):
    # ``_arrive`` takes an arrival, ``_on_tick`` runs at every step of the clock, after the
    # engines' updates, and ``_wake_at`` is the next time the loop must stop for it.
    def _arrive(self, i: int, arrival: float) -> None:
        self._route(i, arrival)

    def _on_tick(self) -> None:
        pass

    def _wake_at(self) -> float:
        return math.inf

    def _route(self, i: int, arrival: float, eligible: list[int] | None = None) -> None:
        """Place request ``i`` (arrived at ``arrival``) now, among ``eligible`` replicas (default all)."""
        self._send(i, arrival, *self._decide(i, eligible))

    def _decide(self, i: int, eligible: list[int] | None = None) -> tuple[Query, Any]:
        """lookup -> choose for request ``i`` now (the router's own steps, router/placement/sequence.py,
        on the memory index with virtual time); nothing committed yet."""
        req = self.requests[i]
        query = Query(
            chain=self.prepared.chains[i].tolist(),
            prompt_tokens=int(self.prepared.prompt_tokens[i]),
            block_size=self.block_size,
            session_key=req.session_key,
            text=text_proxy(req.tokens()) if self.policy.needs_text else "",
            now=self.now,
        )
        replicas = [snapshot(self.names[k], self.tracker, self.engines[k].num_running)
                    for k in (range(len(self.names)) if eligible is None else eligible)]
        query = drive(self.placement.lookup(query))
        return query, self.placement.choose(query, replicas)

    def _send(self, i: int, arrival: float, query: Query, choice: Any) -> None:
        """commit -> the engine: request ``i`` goes to ``choice.replica`` now."""
        req = self.requests[i]
        self.placement.commit(query, choice, req.request_id)
        pos = self._replica_pos[choice.replica]
        run = self.run
        run.arrival[i] = arrival
        run.replica[i] = pos
        run.predicted_blocks[i] = choice.matched_blocks
        run.index_blocks[i] = query.matches.get(choice.replica, 0)
        run.reasons[choice.reason] = run.reasons.get(choice.reason, 0) + 1
        self._order.append(i)
        self._sent_at[i] = self.now
        self.engines[pos].submit(self._EngineRequest(req.request_id, list(query.chain), query.prompt_tokens, req.max_tokens), self.now)

    def _apply_kv_events(self) -> None:
        for name, ev in self._kv:
            kind = type(ev).__name__
            if kind == "BlockStored":
                drive(self.index.confirm(name, ev.block_hashes))
            elif kind == "BlockRemoved":
                drive(self.index.remove(name, ev.block_hashes))
            elif kind == "AllBlocksCleared":
                drive(self.index.clear_replica(name))
        self._kv.clear()

    def _on_update(self, u: Any) -> int:
        """Returns 1 when the update ends a request."""
        i = int(u.request_id[1:])
        run = self.run
        if u.kind == "first_token":
            run.first_token[i] = u.time
            run.cached_tokens[i] = u.cached_tokens
            # the router's own steps after the answer (router/placement/sequence.py), as the router calls them
            # the router times the replica from when it sent the request (a held one waited before)
            self.placement.first_token(u.request_id, u.time - self._sent_at[i], u.time)
            return 0
        if u.kind in ("finished", "aborted"):
            run.finish[i] = u.time
            if u.cached_tokens and not run.cached_tokens[i]:
                run.cached_tokens[i] = u.cached_tokens
            self.placement.finished(u.request_id)
            for j in self._dependents.get(i, ()):
                release = u.time + self.requests[j].think_s
                if release < self._end:  # past the window: the conversation is cut here
                    heapq.heappush(self._arrivals, (release, j))
            return 1
        return 0

    # -- the event loop ---------------------------------------------------------------------
    def simulate(self, progress: Callable[[int], None] | None = None) -> RunResult:
        arrivals = self._arrivals
        engines = self.engines
        while True:
            t_next = arrivals[0][0] if arrivals else math.inf
            busy = [e for e in engines if e.next_step_time() is not None]
            t_next = min(t_next, self._wake_at())
            if not busy:
                if t_next == math.inf:
                    break
                horizon = t_next
            else:
                horizon = min(t_next, self.now + self.window)
            updates: list[tuple[float, int, Any]] = []
            for k, e in enumerate(busy):
                step = e.next_step_time()  # with horizon inf (nothing more will arrive): drain
                if step is not None and step <= horizon:
                    updates.extend((u.time, k, u) for u in e.run_until(horizon))
            if self._kv:
                self._apply_kv_events()
            if updates:
                updates.sort(key=lambda x: (x[0], x[1]))
                done = 0
                for _, _, u in updates:
                    done += self._on_update(u)
                if done and progress is not None:
                    progress(done)
            if horizon == math.inf:
                continue
            self.now = max(self.now, horizon)
            self._on_tick()
            while arrivals and arrivals[0][0] <= self.now:
                t, i = heapq.heappop(arrivals)
                self._arrive(i, t)
        run = self.run
        run.available[self._order] = available_blocks([self.prepared.chains[i].tolist() for i in self._order])
        run.limit_ttft = np.full(len(self.requests), np.nan)
        run.limit_ttft[self._order] = limit_ttfts(
            self.cfg.profile, run.prompt_tokens[self._order], run.available[self._order], self.block_size
        )
        return run


def simulate_policy(
    prepared: PreparedWorkload,
    policy: Policy,
    cfg: FleetConfig,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    return FleetSim(prepared, policy, cfg).simulate(progress)
