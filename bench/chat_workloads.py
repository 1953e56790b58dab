"""Generated chat workloads, as chat-trace rows (bench/chat_trace.py), deterministic from a seed.

Every text comes from `kvroute.bench.chat_text.chat_text` (prose, code, tables, JSON, CJK, identifiers
mixed paragraph by paragraph), so characters per token change along one message as they do in
real traffic.  Lengths are drawn in tokens and written as characters at the mix's average
(`CHARS_PER_TOKEN`, the tiny tokenizer's); the real token counts therefore scatter around the
drawn ones, as real pasted text does.  Contexts are capped with real token counts (a token
counter, by default the tiny tokenizer's): every prompt plus its reply stays under
`max_context_tokens`, below the emulated replicas' 32k-token context.

Workloads (``rows(name, seed, requests)``):

- ``conversation``: the real-chat shape that broke a routing change (docs/routing-gate.md): many
  sessions, each opening with one of a few shared system prompts of several sizes (Zipf
  popularity), a first user turn that is long and new (heavy-tailed lognormal, up to tens of
  thousands of tokens: a line of instruction, then one pasted material — a document, a code
  file, a table, JSON, CJK text — whose characters per token its first line does not tell),
  then turns that add an assistant reply
  and a short (heavy-tailed) user message to the history; think times between turns; sessions
  start as a Poisson process and overlap.
- ``sessions``: LMCache's multi-round QA (bench/workloads.py `SessionsConfig`: a shared system
  prompt, a long user-specific context, short questions and answers) as chats.
- ``handbook``: one hot shared document (a few thousand tokens) as the system message and a
  short, unique question per request; Poisson arrivals, no sessions.

Timestamps are nominal (one session start, or one handbook question, per second on average);
a replay's ``--speedup`` sets the real rate.  Every draw comes from a generator keyed by (seed,
purpose[, session]), so a session's text does not depend on how many others are built; a
workload of N requests is the first sessions' turns, the last session cut at N.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .chat_text import chat_text, pasted_text
from .workloads import LogNormal

CHARS_PER_TOKEN = 1.4  # chat_text's default mix through the tiny tokenizer (100k characters: 1.44)
MESSAGE_OVERHEAD_TOKENS = 5  # <|im_start|>role\n ... <|im_end|>\n, and the generation prompt
CONTEXT_MARGIN_TOKENS = 64
MAX_CONTEXT_TOKENS = 30_000  # prompt + reply, below the emulated replicas' 32,768


@dataclass(frozen=True)
class Uniform:
    lo: float
    hi: float
    integer: bool = True

    def draw(self, rng: np.random.Generator) -> float:
        return int(rng.integers(int(self.lo), int(self.hi) + 1)) if self.integer else float(rng.uniform(self.lo, self.hi))


@dataclass(frozen=True)
class ShiftedExp:
    """``min + exponential(mean)``, at most ``hi`` (a think time)."""

    min: float
    mean: float
    hi: float = math.inf

    def draw(self, rng: np.random.Generator) -> float:
        return min(self.min + float(rng.exponential(self.mean)), self.hi)


Dist = LogNormal | Uniform | ShiftedExp


@dataclass(frozen=True)
class ChatShape:
    """A multi-turn chat workload.  Lengths in tokens, times in nominal seconds."""

    system_tokens: tuple[int, ...]  # the shared system prompts
    zipf: bool  # their popularity: Zipf(1) in the order given, else uniform
    first_message: Dist
    message: Dist
    reply: Dist  # max_tokens of a turn, and the length of the reply the next turn re-sends
    turns: Dist
    think_s: Dist  # after the previous turn's expected answer
    response_estimate_s: float  # a turn's expected duration: the next one comes after it + think
    session_gap_s: float = 1.0  # mean gap between session starts (Poisson)
    max_context_tokens: int = MAX_CONTEXT_TOKENS
    pasted_first_turn: bool = False  # a first turn is an instruction and one pasted material (chat_text.pasted_text)


# Sizes and times: docs/routing-gate.md says why.
CONVERSATION = ChatShape(
    system_tokens=(2000, 500, 6000, 1200),
    zipf=True,
    first_message=LogNormal(5000, 0.9, 300, 24000),
    message=LogNormal(150, 1.2, 8, 4000),
    reply=LogNormal(150, 0.6, 32, 512),
    turns=LogNormal(3, 0.6, 1, 12),
    think_s=LogNormal(20.0, 0.5, 8.0, 60.0, integer=False),
    response_estimate_s=4.0,
    pasted_first_turn=True,
)
SESSIONS = ChatShape(  # bench/workloads.py SessionsConfig's numbers
    system_tokens=(900, 1400, 600, 1100),
    zipf=False,
    first_message=LogNormal(5000, 0.6, 256, 24000),
    message=LogNormal(120, 0.8, 8, 4000),
    reply=Uniform(100, 300),
    turns=Uniform(3, 8),
    think_s=ShiftedExp(2.0, 10.0, 60.0),
    response_estimate_s=4.0,
)


@dataclass(frozen=True)
class HandbookShape:
    document_tokens: int = 4000
    question: Dist = LogNormal(40, 0.6, 8, 400)
    answer: Dist = Uniform(100, 300)
    gap_s: float = 1.0  # mean gap between questions (Poisson)


HANDBOOK = HandbookShape()

TokenCounter = Callable[[str], int]


@lru_cache(maxsize=1)
def tiny_counter() -> TokenCounter:
    """Tokens of a text through the tiny tokenizer (the emulated replicas' and the gate's)."""
    from kvroute.replica.assets import TINY_TOKENIZER
    from kvroute.common.tokens import Tokenizer

    tok = Tokenizer.from_dir(TINY_TOKENIZER)
    return lambda text: len(tok.encode(text))


def chars(tokens: float) -> int:
    return max(1, round(tokens * CHARS_PER_TOKEN))


def _zipf(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


def _fit(text: str, budget: int, count: TokenCounter) -> tuple[str, int]:
    """The longest prefix of ``text`` with at most ``budget`` tokens (bisected on characters; a
    text's characters per token vary along it); and its token count."""
    n = count(text)
    if n <= budget:
        return text, n
    lo, hi = 0, len(text)  # count(text[:lo]) <= budget < count(text[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid
    return text[: max(lo, 1)], count(text[: max(lo, 1)])


def session_rows(name: str, shape: ChatShape, seed: int, requests: int, count: TokenCounter | None = None) -> list[dict[str, Any]]:
    """``requests`` rows of multi-turn chats of ``shape``, sorted by timestamp."""
    if requests < 1:
        raise ValueError("requests must be at least 1")
    count = count or tiny_counter()
    system_texts = [chat_text((seed, 0, k), chars(n)) for k, n in enumerate(shape.system_tokens)]
    system_counts = [count(t) for t in system_texts]
    weights = _zipf(len(system_texts)) if shape.zipf else np.full(len(system_texts), 1 / len(system_texts))
    starts = np.random.default_rng([seed, 1])
    limit = shape.max_context_tokens - CONTEXT_MARGIN_TOKENS
    rows: list[dict[str, Any]] = []
    t = 0.0
    s = 0
    while len(rows) < requests:
        if s:
            t += float(starts.exponential(shape.session_gap_s))
        rng = np.random.default_rng([seed, 2, s])
        k = int(rng.choice(len(system_texts), p=weights))
        turns = int(shape.turns.draw(rng))
        messages = [{"role": "system", "content": system_texts[k]}]
        context = system_counts[k] + 2 * MESSAGE_OVERHEAD_TOKENS  # + the generation prompt
        now = t
        for turn in range(turns):
            if len(rows) >= requests:
                break
            drawn = int((shape.message if turn else shape.first_message).draw(rng))
            reply = int(shape.reply.draw(rng))
            think = float(shape.think_s.draw(rng)) if turn else 0.0
            budget = limit - context - reply - MESSAGE_OVERHEAD_TOKENS
            want = min(drawn, max(budget, 1))
            if turn == 0 and shape.pasted_first_turn:
                text = pasted_text((seed, 3, s, turn), want)
            else:
                text = chat_text((seed, 3, s, turn), chars(want))
            if turn == 0:
                text, n = _fit(text, budget, count)  # a first turn always fits (cut if need be)
            else:
                n = count(text)
                if n > budget:
                    break  # the conversation outgrew the context: the user starts anew
            if turn:
                now += shape.response_estimate_s + think
            messages = messages + [{"role": "user", "content": text}]
            rows.append({"timestamp": round(now * 1000), "session_id": f"{name}-{seed}-{s}",
                         "messages": messages, "max_tokens": reply})
            answer = chat_text((seed, 4, s, turn), chars(reply))
            messages = messages + [{"role": "assistant", "content": answer}]
            context += n + count(answer) + 2 * MESSAGE_OVERHEAD_TOKENS
        s += 1
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def handbook_rows(seed: int, requests: int, shape: HandbookShape = HANDBOOK, count: TokenCounter | None = None) -> list[dict[str, Any]]:
    """One shared document (``document_tokens``, counted) as the system message, a unique short
    question per request; Poisson."""
    if requests < 1:
        raise ValueError("requests must be at least 1")
    count = count or tiny_counter()
    size = chars(shape.document_tokens)
    while count(text := chat_text((seed, 0), size)) < shape.document_tokens:
        size *= 2
    document = "Answer from this handbook.\n\n" + _fit(text, shape.document_tokens, count)[0]
    rng = np.random.default_rng([seed, 1])
    rows = []
    t = 0.0
    for i in range(requests):
        if i:
            t += float(rng.exponential(shape.gap_s))
        question = chat_text((seed, 3, i), chars(shape.question.draw(rng)))
        answer = int(shape.answer.draw(rng))
        rows.append({"timestamp": round(t * 1000), "session_id": None,
                     "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
                     "max_tokens": answer})
    return rows


SHAPES: dict[str, ChatShape] = {"conversation": CONVERSATION, "sessions": SESSIONS}
WORKLOADS = ("conversation", "sessions", "handbook")


def rows(name: str, seed: int, requests: int, count: TokenCounter | None = None) -> list[dict[str, Any]]:
    """The named workload's first ``requests`` rows (chat-trace rows, sorted by timestamp)."""
    if name == "handbook":
        return handbook_rows(seed, requests, count=count)
    if name in SHAPES:
        return session_rows(name, SHAPES[name], seed, requests, count)
    raise ValueError(f"unknown chat workload {name!r}; choose from {', '.join(WORKLOADS)}")


def nominal_rate(rows_: list[dict[str, Any]]) -> float:
    """Requests per second of the rows' own timestamps."""
    span = (rows_[-1]["timestamp"] - rows_[0]["timestamp"]) / 1000.0 if len(rows_) > 1 else 0.0
    return (len(rows_) - 1) / span if span > 0 else 1.0


def sim_workload(name: str, rows_: list[dict[str, Any]], token_ids: list[Any], seconds_per_ms: float = 1e-3) -> Any:
    """The rows as the fleet simulator's open-loop requests (bench/workloads.py `Workload`): each
    row's tokens (its messages rendered with the chat template and encoded, in row order), its
    max_tokens and session, arriving ``seconds_per_ms`` simulated seconds per millisecond of its
    timestamp after the first row."""

    from .workloads import SimRequest, Workload

    t0 = rows_[0]["timestamp"] if rows_ else 0
    reqs = []
    for i, (row, ids) in enumerate(zip(rows_, token_ids, strict=True)):
        arr = np.asarray(ids, dtype=np.uint32)
        reqs.append(SimRequest(i, arr.copy, int(row["max_tokens"]), row.get("session_id"),
                               arrival_s=(row["timestamp"] - t0) * seconds_per_ms))
    span = reqs[-1].arrival_s if reqs and reqs[-1].arrival_s else 0.0
    return Workload(name, reqs, (len(reqs) - 1) / span if span > 0 else 1.0)
