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
- `handbook`: one long shared document and a short, unique question per request; Poisson arrivals.
- `trace`: a Mooncake-format JSONL trace (`hash_ids` of 512-token blocks; equal id prefixes are
  shared prompt prefixes), timestamps in ms.
- `random`: unique random prompts: no reuse at all, the control.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from itertools import count, islice
from pathlib import Path

import numpy as np

VOCAB_SIZE = 128_000  # Llama-3's vocabulary: token ids are drawn below it
TRACE_BLOCK_TOKENS = 512  # Mooncake traces: one hash id per 512-token block
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

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
    return int(np.clip(round(rng.lognormal(math.log(median), sigma)), lo, hi))


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

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    @property
    def lifetime_s(self) -> float:
        """Expected span of a session, first arrival to last finish."""
        gaps = self.mean_turns - 1
        return gaps * (self.think_min_s + self.think_mean_s) + self.mean_turns * self.response_estimate_s


def sessions_stream(
    seed: int,
    cfg: SessionsConfig = SessionsConfig(),
    time_scale: float = 1.0,
    until_s: float | None = None,
) -> Iterator[SimRequest]:
    """Sessions in order of start, each followed by its turns; `time_scale` s between starts on
    average.  Ends with the last session starting before `until_s` (endless without it)."""
    sys_rng = np.random.default_rng([seed, 0])
    system = [
        _random_tokens(sys_rng, sys_rng.integers(cfg.system_tokens[0], cfg.system_tokens[1] + 1))
        for _ in range(cfg.system_prompts)
    ]
    starts = np.random.default_rng([seed, 1])
    index = count()
    t = -cfg.lifetime_s if cfg.warm_start else 0.0
    for session in count():
        t += starts.exponential(time_scale)
        if until_s is not None and t >= until_s:
            return
        rng = np.random.default_rng([seed, 2, session])
        history: tuple[np.ndarray, ...] = (system[int(rng.integers(cfg.system_prompts))],)
        key = f"session-{session}"
        prev: int | None = None
        nominal = t  # when this turn would be sent at the estimated response time (warm start)
        for turn in range(int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))):
            if turn == 0:
                size = _lognormal_int(rng, cfg.first_message_median, cfg.first_message_sigma, *cfg.first_message_bounds)
            else:
                size = _lognormal_int(rng, cfg.message_median, cfg.message_sigma, *cfg.message_bounds)
            history = history + (_random_tokens(rng, size),)
            reply = int(rng.integers(cfg.reply_tokens[0], cfg.reply_tokens[1] + 1))
            think = cfg.think_min_s + rng.exponential(cfg.think_mean_s) if turn else 0.0
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
            nominal += cfg.response_estimate_s


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
    with open(path) as f:
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

WORKLOADS = ("sessions", "handbook", "trace", "random")
# Sized so that `--policy all` runs in well under 3 minutes on 2 shared cores.  The trace's
# default is its first 2,000 requests (its reuse grows along it: 33% of blocks over these, 64%
# over all 3,993; `--requests 3993` replays the whole trace in about twice the time).
DEFAULT_REQUESTS = {"sessions": 3000, "handbook": 3000, "trace": 2000, "random": 3000}


def unit_rate(name: str, trace_rows: list[dict] | None = None, sessions: SessionsConfig | None = None) -> float:
    """The workload's request rate (req/s) at time scale 1."""
    if name == "sessions":
        return (sessions or SessionsConfig()).mean_turns  # one session per second; long-run rate
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
    sessions: SessionsConfig | None = None,
) -> Iterator[SimRequest]:
    """The workload's requests with arrival times at `time_scale`, up to `until_s` if given."""
    if name == "sessions":
        return sessions_stream(seed, sessions or SessionsConfig(), time_scale, until_s)
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
    sessions: SessionsConfig | None = None,
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
    if name == "sessions":
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
