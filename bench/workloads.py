"""Synthetic and replayed request streams for the fleet simulator.

Every workload is deterministic from its seed and yields `SimRequest`s: prompt token ids (numpy
uint32, built on demand so a long trace never sits in memory), the output length, an optional
session key, and either an open-loop arrival time or a dependency (closed loop: sent a think time
after an earlier request finished).  A time scale stretches arrivals to reach a request rate
(`Workload.unit_rate` is the rate at scale 1); think times are human time and never scale.

Workloads:
- `sessions`: multi-turn chat.  Sessions start as a Poisson process; each opens with one of a few
  shared system prompts; every turn re-sends the whole history (previous assistant replies and
  user messages) plus a new user message, so each prompt extends the previous turn's prompt.
- `conversation`: production-like chat on the same machinery: many more sessions than replicas,
  heavy-tailed context lengths, turns minutes apart (caches churn), shared system prompts of
  several sizes, bursts (`ConversationConfig` says why each parameter is what it is).
- `handbook`: one long shared document and a short, unique question per request; Poisson arrivals.
- `trace`: a Mooncake-format JSONL trace (`hash_ids` of 512-token blocks; equal id prefixes are
  shared prompt prefixes), timestamps in ms.
- `random`: unique random prompts: no reuse at all, the control.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from itertools import count, islice
from pathlib import Path

import numpy as np

VOCAB_SIZE = 128_000  # Llama-3's vocabulary: token ids are drawn below it
TRACE_BLOCK_TOKENS = 512  # Mooncake traces: one hash id per 512-token block
# Mooncake's synthetic trace (bench/data/README.md), shipped in the package: `--workload trace` runs
# from an installed wheel without a checkout.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"
DEFAULT_TRACE_NAME = "Mooncake's synthetic trace (packaged)"  # what --help shows instead of a path

_TOKEN_DTYPE = np.uint32


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload; `index` is its position in the workload and its id."""

    index: int
    build_tokens: Callable[[], np.ndarray]  # prompt token ids, rebuilt on each call
    max_tokens: int
    session_key: str | None = None
    arrival_s: float | None = None  # open loop (and first turns): arrival time
    after: int | None = None  # closed loop: index of the request whose finish releases this one
    think_s: float = 0.0  # delay between that finish and this request's arrival
    turn: int = 0  # position in its conversation (sessions)

    @property
    def request_id(self) -> str:
        return f"r{self.index}"

    def tokens(self) -> np.ndarray:
        return self.build_tokens()


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    unit_rate: float  # request rate (req/s) at time scale 1
    time_scale: float = 1.0  # already applied to the requests' arrival times
    # Closed loop: a turn released at or after this time is not sent (nor anything after it).
    # The run is a window on a service that goes on: conversations are cut, not drained.
    end_s: float | None = None

    @property
    def min_think_s(self) -> float:
        """Smallest delay between a finish and the arrival it releases (inf for open loop)."""
        thinks = [r.think_s for r in self.requests if r.after is not None]
        return min(thinks) if thinks else math.inf

    @property
    def rate(self) -> float:
        return self.unit_rate / self.time_scale


def text_proxy(tokens: np.ndarray) -> str:
    """The prompt as text for baselines that match characters (SGLang's cache_aware).

    One character per token (a fixed map into the Basic Multilingual Plane below the surrogates):
    equal token prefixes give equal text prefixes, and match *ratios*, which is what those
    rules compare, are the same as with real text at a quarter of the cost.
    """
    chars = (np.asarray(tokens, dtype=np.uint32) % 0xD000 + 0x100).astype("<u4")
    return chars.tobytes().decode("utf-32-le")


def _random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB_SIZE, size=int(n), dtype=_TOKEN_DTYPE)


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(max(round(float(rng.lognormal(math.log(median), sigma))), lo), hi)  # np.clip: 10x slower on scalars


def _concat(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.concatenate(parts)


# --- sessions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionsConfig:
    """Multi-turn chat.  Lengths in tokens, times in seconds.

    Shaped like LMCache's multi-round QA benchmark (a shared system prompt plus a long
    user-specific context, short questions, short answers), which vLLM's production stack uses
    to evaluate KV-aware routing.  The mix decides what any router can gain: the shared system
    prompts are cached everywhere whatever the routing, so only the per-session history rewards
    affinity.  Here the system prompt is about a sixth of a turn's prompt on average.

    The draw methods are the shape `session_stream` asks any session workload for (also
    `ConversationConfig`); their order of draws on a session's generator is part of the seed's
    meaning.
    """

    system_prompts: int = 4
    system_tokens: tuple[int, int] = (500, 1500)  # uniform range of each shared system prompt
    turns: tuple[int, int] = (3, 8)  # uniform, inclusive
    # The first user message carries the material the conversation is about (a pasted document,
    # code files, retrieved passages): session-unique context that every later turn re-sends.
    first_message_median: float = 5000.0
    first_message_sigma: float = 0.6
    first_message_bounds: tuple[int, int] = (256, 24000)
    message_median: float = 120.0  # follow-up questions
    message_sigma: float = 0.8
    message_bounds: tuple[int, int] = (8, 4000)
    reply_tokens: tuple[int, int] = (100, 300)  # uniform, inclusive: max_tokens of each turn
    # Think time = min + exponential(mean): reading a reply and typing the next message.  The
    # min is also the simulator's safe look-ahead window.
    think_min_s: float = 2.0
    think_mean_s: float = 10.0
    # Warm start: sessions also start during the `lifetime_s` before the run, so the run opens
    # on a steady population of conversations instead of ramping up over a session's lifetime.
    # Their turns before time 0 are not sent (their history still is, on the first turn sent):
    # a fleet that comes up cold while users are mid-conversation.
    warm_start: bool = True
    response_estimate_s: float = 4.0  # a turn's duration, only to place those first turns
    max_context_tokens: int | None = None  # a session ends before a prompt would exceed it

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    @property
    def lifetime_s(self) -> float:
        """Expected span of a session, first arrival to last finish."""
        gaps = self.mean_turns - 1
        return gaps * (self.think_min_s + self.think_mean_s) + self.mean_turns * self.response_estimate_s

    @property
    def warm_up_s(self) -> float:
        """How long before time 0 sessions start (warm start)."""
        return self.lifetime_s if self.warm_start else 0.0

    def system_prompt_tokens(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng([seed, 0])
        return [_random_tokens(rng, rng.integers(self.system_tokens[0], self.system_tokens[1] + 1)) for _ in range(self.system_prompts)]

    def session_starts(self, seed: int, time_scale: float, t0: float) -> Iterator[float]:
        """Session start times after `t0`: Poisson, `time_scale` s apart on average."""
        rng = np.random.default_rng([seed, 1])
        t = t0
        while True:
            t += rng.exponential(time_scale)
            yield t

    def draw_system(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.system_prompts))

    def draw_turns(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.turns[0], self.turns[1] + 1))

    def draw_message(self, rng: np.random.Generator, turn: int) -> int:
        if turn == 0:
            return _lognormal_int(rng, self.first_message_median, self.first_message_sigma, *self.first_message_bounds)
        return _lognormal_int(rng, self.message_median, self.message_sigma, *self.message_bounds)

    def draw_reply(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.reply_tokens[0], self.reply_tokens[1] + 1))

    def draw_think(self, rng: np.random.Generator) -> float:
        return self.think_min_s + rng.exponential(self.think_mean_s)


def sessions_stream(
    seed: int,
    cfg: SessionsConfig | ConversationConfig = SessionsConfig(),
    time_scale: float = 1.0,
    until_s: float | None = None,
) -> Iterator[SimRequest]:
    """Sessions in order of start, each followed by its turns; `time_scale` s between starts on
    average.  Ends with the last session starting before `until_s` (endless without it).

    `cfg` is any session shape: `SessionsConfig`, `ConversationConfig`."""
    system = cfg.system_prompt_tokens(seed)
    index = count()
    for session, t in enumerate(cfg.session_starts(seed, time_scale, -cfg.warm_up_s)):
        if until_s is not None and t >= until_s:
            return
        rng = np.random.default_rng([seed, 2, session])
        history: tuple[np.ndarray, ...] = (system[cfg.draw_system(rng)],)
        context = history[0].size
        key = f"session-{session}"
        prev: int | None = None
        nominal = t  # when this turn would be sent at the estimated response time (warm start)
        for turn in range(cfg.draw_turns(rng)):
            size = cfg.draw_message(rng, turn)
            history = history + (_random_tokens(rng, size),)
            reply = cfg.draw_reply(rng)
            think = cfg.draw_think(rng) if turn else 0.0
            context += size
            if cfg.max_context_tokens is not None and context + reply > cfg.max_context_tokens:
                break  # the conversation outgrew the model's context window: the user starts anew
            nominal += think
            build = partial(_concat, history)
            if prev is not None:
                i = next(index)
                yield SimRequest(i, build, reply, key, after=prev, think_s=think, turn=turn)
                prev = i
            elif nominal >= 0 and (until_s is None or nominal < until_s):
                prev = next(index)
                yield SimRequest(prev, build, reply, key, arrival_s=nominal, turn=turn)
            # The next turn re-sends this turn's reply; the emulated engine produces no content,
            # so the reply's tokens are drawn here, deterministically.
            history = history + (_random_tokens(rng, reply),)
            context += reply
            nominal += cfg.response_estimate_s


# --- conversation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LogNormal:
    """A lognormal size or time, clipped to [lo, hi], rounded to an integer unless told not to."""

    median: float
    sigma: float
    lo: float
    hi: float
    integer: bool = True

    def draw(self, rng: np.random.Generator) -> float:
        x = min(max(float(rng.lognormal(math.log(self.median), self.sigma)), self.lo), self.hi)
        return round(x) if self.integer else x

    def mean(self) -> float:
        """Of the clipped (and rounded) distribution, from a fixed-seed sample."""
        draws = np.clip(np.random.default_rng(0).lognormal(math.log(self.median), self.sigma, 200_000), self.lo, self.hi)
        return float((np.round(draws) if self.integer else draws).mean())


@dataclass(frozen=True)
class ConversationConfig:
    """Production-like chat: a long-tailed mix of conversations, minutes between turns, bursts.

    Lengths in tokens, times in seconds.  Every size is drawn from a distribution whose spread
    matches what public chat logs show, not tuned to any router: the point is a fleet whose KV
    caches cannot hold every live conversation, where a router must choose what to keep.

    - Many sessions, few replicas: at the simulator's default load (75% of the fleet under
      round-robin) hundreds of conversations are live per replica; with turns minutes apart their
      histories do not all fit the replicas' KV caches (444k tokens each with the H100 profile),
      so caches churn and a turn's history may be gone when it comes back.
    - Shared system prompts of several sizes (`system_tokens`: a 150-token persona to a
      12k-token agent/tool specification), Zipf(1) popular in the order given: a few apps carry
      most of the traffic.  They are the cross-session reuse every policy can get.
    - Heavy-tailed session material: the first message is lognormal (median 800, sigma 1.5: p90
      ~5k, p99 ~26k, up to 32k tokens: a question, a pasted file, a whole document), follow-ups
      lognormal (median 100, sigma 1.3, up to 8k: mostly short, sometimes a paste), replies
      lognormal (median 300, sigma 0.8, 16-2048; re-sent in the history).  Turn counts lognormal
      (median 3, sigma 1, 1-40: most chats are short, some go on for dozens of turns), as in
      LMSYS-Chat-1M and ShareGPT; contexts thus range from a few hundred to tens of thousands of
      tokens, capped at `max_context_tokens` (a served --max-model-len; the session ends there).
    - Think time lognormal (median 45 s, sigma 1.1, 5 s to 30 min): reading a reply and writing
      the next message; the tail is a user who comes back later.  The 5 s floor is also the
      simulator's look-ahead window.
    - Bursts: sessions start as a Poisson process whose rate is `burst_factor` times higher during
      one `burst_s` stretch at a random place in every `burst_period_s` (mean rate unchanged):
      a news event, a batch job, the start of a working day, compressed.
    - Warm start over `warm_up_s` (30 min, most sessions' whole life): the window opens on a
      steady population of conversations, their turns before time 0 not sent (as `sessions`).
    """

    system_tokens: tuple[int, ...] = (1200, 300, 4000, 700, 12000, 2500, 150, 7000)
    first_message: LogNormal = LogNormal(800, 1.5, 16, 32000)
    message: LogNormal = LogNormal(100, 1.3, 4, 8000)
    reply: LogNormal = LogNormal(300, 0.8, 16, 2048)
    turns: LogNormal = LogNormal(3, 1.0, 1, 40)
    think_s: LogNormal = LogNormal(45.0, 1.1, 5.0, 1800.0, integer=False)
    burst_period_s: float = 300.0
    burst_s: float = 45.0
    burst_factor: float = 4.0
    warm_up_s: float = 1800.0
    response_estimate_s: float = 10.0  # a turn's duration, only to place warm-started first turns
    max_context_tokens: int | None = 65536

    @property
    def mean_turns(self) -> float:
        """Mean turns per session (of the clipped lognormal, by a fixed-seed sample)."""
        return self.turns.mean()

    def system_prompt_tokens(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng([seed, 0])
        return [_random_tokens(rng, n) for n in self.system_tokens]

    def rate_multiplier(self, seed: int, t: float) -> float:
        """Session start rate at `t` relative to the mean (bursts; mean 1 over every period)."""
        period = math.floor(t / self.burst_period_s)
        offset = _burst_offset(seed, period, self.burst_period_s - self.burst_s)
        in_burst = offset <= t - period * self.burst_period_s < offset + self.burst_s
        return self._calm * self.burst_factor if in_burst else self._calm

    @property
    def _calm(self) -> float:
        """The multiplier outside bursts: the one that keeps the mean at 1."""
        return 1.0 / (1.0 + (self.burst_factor - 1.0) * self.burst_s / self.burst_period_s)

    def session_starts(self, seed: int, time_scale: float, t0: float) -> Iterator[float]:
        """Session start times after `t0`, `time_scale` s apart on average: a Poisson process
        modulated by `rate_multiplier` (thinning)."""
        rng = np.random.default_rng([seed, 1])
        peak = self._calm * self.burst_factor
        t = t0
        while True:
            t += rng.exponential(time_scale / peak)
            if rng.random() * peak < self.rate_multiplier(seed, t):
                yield t

    def draw_system(self, rng: np.random.Generator) -> int:
        return int(rng.choice(len(self.system_tokens), p=_zipf_weights(len(self.system_tokens))))

    def draw_turns(self, rng: np.random.Generator) -> int:
        return int(self.turns.draw(rng))

    def draw_message(self, rng: np.random.Generator, turn: int) -> int:
        return int((self.message if turn else self.first_message).draw(rng))

    def draw_reply(self, rng: np.random.Generator) -> int:
        return int(self.reply.draw(rng))

    def draw_think(self, rng: np.random.Generator) -> float:
        return self.think_s.draw(rng)


@lru_cache(maxsize=4096)
def _burst_offset(seed: int, period: int, span: float) -> float:
    """Where the burst of one period starts in it (periods before time 0 have negative numbers)."""
    return float(np.random.default_rng([seed, 3, period + 2**40]).uniform(0, span))


def _zipf_weights(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


# --- handbook ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HandbookConfig:
    document_tokens: tuple[int, int] = (6000, 8000)
    question_median: float = 40.0
    question_sigma: float = 0.6
    question_bounds: tuple[int, int] = (8, 400)
    answer_tokens: tuple[int, int] = (100, 300)


def handbook_stream(seed: int, cfg: HandbookConfig = HandbookConfig()) -> Iterator[SimRequest]:
    """One long shared document, a different short question each time; Poisson, unit rate."""
    doc_rng = np.random.default_rng([seed, 0])
    document = _random_tokens(doc_rng, doc_rng.integers(cfg.document_tokens[0], cfg.document_tokens[1] + 1))
    rng = np.random.default_rng([seed, 1])
    t = 0.0
    for i in count():
        t += rng.exponential(1.0)
        question = _random_tokens(rng, _lognormal_int(rng, cfg.question_median, cfg.question_sigma, *cfg.question_bounds))
        answer = int(rng.integers(cfg.answer_tokens[0], cfg.answer_tokens[1] + 1))
        yield SimRequest(i, partial(_concat, (document, question)), answer, arrival_s=t)


# --- random -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RandomConfig:
    prompt_median: float = 2000.0
    prompt_sigma: float = 0.6
    prompt_bounds: tuple[int, int] = (16, 16000)
    output_tokens: tuple[int, int] = (100, 300)


def _seeded_tokens(seed: int, index: int, n: int) -> np.ndarray:
    return _random_tokens(np.random.default_rng([seed, 2, index]), n)


def random_stream(seed: int, cfg: RandomConfig = RandomConfig()) -> Iterator[SimRequest]:
    """Unique random prompts (each from its own generator, so nothing is shared); Poisson."""
    rng = np.random.default_rng([seed, 1])
    t = 0.0
    for i in count():
        t += rng.exponential(1.0)
        n = _lognormal_int(rng, cfg.prompt_median, cfg.prompt_sigma, *cfg.prompt_bounds)
        out = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        yield SimRequest(i, partial(_seeded_tokens, seed, i, n), out, arrival_s=t)


# --- trace ------------------------------------------------------------------------------------

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def trace_block_tokens(hash_ids: Iterable[int]) -> np.ndarray:
    """512 deterministic token ids per hash id (splitmix64 of (id, position)), concatenated.

    Vectorised: a 15k-token prompt costs tens of microseconds, not one generator per block.
    """
    ids = np.asarray(list(hash_ids), dtype=np.uint64)
    pos = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (ids[:, None] + np.uint64(1)) * _GOLDEN + pos[None, :]
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z ^= z >> np.uint64(31)
    return (z.reshape(-1) % np.uint64(VOCAB_SIZE)).astype(_TOKEN_DTYPE)


def _trace_tokens(hash_ids: tuple[int, ...], input_length: int) -> np.ndarray:
    return trace_block_tokens(hash_ids)[:input_length]


def load_trace(path: str | Path) -> list[dict]:
    """A Mooncake-format JSONL file, gzipped or not (by its ``.gz`` suffix)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trace_unit_rate(rows: list[dict]) -> float:
    """The trace's own request rate (req/s)."""
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 if len(rows) > 1 else 0.0
    return (len(rows) - 1) / span if span > 0 else 1.0


def trace_stream(rows: list[dict]) -> Iterator[SimRequest]:
    """Replay: timestamps (ms, from the trace's start) as arrivals, output_length as max_tokens."""
    t0 = rows[0]["timestamp"] if rows else 0
    for i, row in enumerate(rows):
        build = partial(_trace_tokens, tuple(row["hash_ids"]), int(row["input_length"]))
        yield SimRequest(i, build, max(1, int(row["output_length"])), arrival_s=(row["timestamp"] - t0) / 1000.0)


# --- assembling a run -------------------------------------------------------------------------

WORKLOADS = ("sessions", "conversation", "handbook", "trace", "random")
# Sized so that `--policy all` runs in well under 3 minutes on 2 shared cores.  The trace's
# default is its first 2,000 requests (its reuse grows along it: 33% of blocks over these, 64%
# over all 3,993; `--requests 3993` replays the whole trace in about twice the time).
DEFAULT_REQUESTS = {"sessions": 3000, "conversation": 4000, "handbook": 3000, "trace": 2000, "random": 3000}
SESSION_WORKLOADS = ("sessions", "conversation")  # closed loop: a request count becomes a window


SessionShape = SessionsConfig | ConversationConfig


def session_shape(name: str, shape: SessionShape | None) -> SessionShape:
    """The given shape of a session workload, or its default."""
    if shape is not None:
        return shape
    return ConversationConfig() if name == "conversation" else SessionsConfig()


def unit_rate(name: str, trace_rows: list[dict] | None = None, sessions: SessionShape | None = None) -> float:
    """The workload's request rate (req/s) at time scale 1."""
    if name in SESSION_WORKLOADS:
        return session_shape(name, sessions).mean_turns  # one session per second; long-run rate
    if name in ("handbook", "random"):
        return 1.0
    if name == "trace":
        return trace_unit_rate(trace_rows or [])
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _scaled(req: SimRequest, time_scale: float) -> SimRequest:
    if req.arrival_s is None or time_scale == 1.0:
        return req
    return replace(req, arrival_s=req.arrival_s * time_scale)


def _open_loop(requests: Iterator[SimRequest], time_scale: float, until_s: float | None) -> Iterator[SimRequest]:
    for req in requests:
        req = _scaled(req, time_scale)
        if until_s is not None and req.arrival_s is not None and req.arrival_s >= until_s:
            return
        yield req


def stream(
    name: str,
    seed: int,
    time_scale: float = 1.0,
    until_s: float | None = None,
    trace_rows: list[dict] | None = None,
    sessions: SessionShape | None = None,
) -> Iterator[SimRequest]:
    """The workload's requests with arrival times at `time_scale`, up to `until_s` if given."""
    if name in SESSION_WORKLOADS:
        return sessions_stream(seed, session_shape(name, sessions), time_scale, until_s)
    if name == "handbook":
        return _open_loop(handbook_stream(seed), time_scale, until_s)
    if name == "random":
        return _open_loop(random_stream(seed), time_scale, until_s)
    if name == "trace":
        return _open_loop(trace_stream(trace_rows or []), time_scale, until_s)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def build_workload(
    name: str,
    *,
    seed: int = 0,
    requests: int | None = None,
    duration_s: float | None = None,
    rate: float | None = None,
    time_scale: float | None = None,
    trace_path: str | Path | None = None,
    sessions: SessionShape | None = None,
) -> Workload:
    """Take a run out of a workload's stream.

    `rate` (req/s) sets the time scale (it wins over `time_scale`).  The run holds the first
    `requests` requests, or those arriving before `duration_s` (a session that starts before it
    keeps all its turns), or both limits; with neither, the workload's default request count.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rows = None
    if name == "trace":
        rows = load_trace(trace_path or DEFAULT_TRACE)
        if not rows:
            raise ValueError(f"empty trace: {trace_path or DEFAULT_TRACE}")
    base_rate = unit_rate(name, rows, sessions)
    if rate is not None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        scale = base_rate / rate
    else:
        scale = time_scale if time_scale is not None else 1.0
    if scale <= 0:
        raise ValueError("time scale must be positive")
    if requests is None and duration_s is None:
        requests = DEFAULT_REQUESTS[name]
    if name in SESSION_WORKLOADS:
        # Closed loop: a request count becomes the window that holds that many at the long-run
        # rate (sessions never ramp up or drain: warm start, and turns after the window are cut).
        end = requests * scale / base_rate if requests is not None else math.inf
        if duration_s is not None:
            end = min(end, duration_s)
        reqs = list(stream(name, seed, scale, end, rows, sessions))
        return Workload(name, reqs, base_rate, scale, end_s=end)
    it = stream(name, seed, scale, duration_s, rows)
    taken = list(it if requests is None else islice(it, requests))
    return Workload(name, taken, base_rate, scale)
