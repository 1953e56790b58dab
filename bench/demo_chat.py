"""The demo's multi-turn chat workload, as text, and its replay through a router over HTTP.

Conversations are built from deterministic English words (a fixed vocabulary drawn by a seeded
generator), so the router's tokenizer and chat template do real work on them: a few system
prompts shared across sessions, a long first user message (the material the conversation is
about), short follow-up questions, and each turn re-sending the whole history, the replies the
replicas really generated included.  The shape is that of the simulator's `sessions` workload
(bench/workloads.py: `SessionsConfig`), smaller, since every token here crosses three
processes' worth of Python (client, router, replica).

Times are *engine* seconds (what the replicas' timing profile models); the replay multiplies
them by the replicas' time scale, so session arrivals and think times keep their proportion to
engine work whatever the speed-up.

Replay is closed loop: each conversation is one task that waits for its start, sends a turn,
reads the streamed answer to the end, thinks, and sends the next.  TTFT is measured here, at the
client: from the request being sent to the first streamed event.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

import aiohttp
import msgspec
import numpy as np

from kvroute.bench.workloads import ConversationConfig, LogNormal

# A fixed vocabulary: the text is "real" for the tokenizer (merges, spaces, punctuation), and
# the same seed gives the same conversations on every machine.
WORDS = tuple(
    """
    the a an and or but if then because while when where which who what how why this that these
    those it its they them their we our you your he she his her one two three four five many few
    more most some any each every all both either neither other another such only own same so
    than too very just also still even already again once here there now today tomorrow always
    never often sometimes router replica cache prefix block token prompt request response stream
    latency throughput session tenant policy metric engine kernel queue prefill decode schedule
    memory layout attention client server shard index model weight layer batch budget window
    chain hash event replay signal drain health probe limit retry timeout error message answer
    question document report table figure chapter section paragraph sentence word letter number
    value result reason method system design review change update release version feature test
    build deploy monitor observe measure compare improve reduce increase keep move send read write
    open close start stop run wait check find learn know think say tell ask give take make use
    work call try need want seem feel become leave put mean bring begin hold turn show hear play
    good new first last long great little old right big high different small large next early
    important few public bad same able late hard major better best real sure clear simple quick
    slow warm cold busy idle fresh stale full empty shared private local remote
    """.split()
)
PUNCTUATION = (".", ",", ";", ":", "?")
_WORD_ARRAY = np.array(WORDS, dtype=object)  # object arrays: element-wise str concatenation
_PUNCTUATION_ARRAY = np.array(PUNCTUATION, dtype=object)


@dataclass(frozen=True)
class ChatConfig:
    """Lengths in words (the tiny tokenizer makes about 2 tokens of one), times in engine seconds."""

    system_prompts: int = 4
    system_words: tuple[int, int] = (300, 900)  # uniform range of each shared system prompt
    turns: tuple[int, int] = (3, 7)  # uniform, inclusive
    first_message_median: float = 2500.0  # the pasted material: session-unique, re-sent every turn
    first_message_sigma: float = 0.5
    first_message_bounds: tuple[int, int] = (300, 8000)
    message_median: float = 40.0  # follow-up questions
    message_sigma: float = 0.7
    message_bounds: tuple[int, int] = (4, 400)
    reply_tokens: tuple[int, int] = (24, 64)  # max_tokens of each turn, uniform, inclusive
    think_min_s: float = 1.0  # think time = min + exponential(mean), at most max: a user who
    think_mean_s: float = 4.0  # thinks longer has left (and would make the run wait for one
    think_max_s: float = 12.0  # straggler, the pass lasting as long as its slowest conversation)

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


@dataclass(frozen=True)
class Turn:
    user_text: str
    max_tokens: int
    think_s: float  # engine seconds between the previous answer's end and this turn (0 for the first)


@dataclass(frozen=True)
class Conversation:
    session_id: str
    system: int  # which shared system prompt opens it
    start_s: float  # engine seconds after the replay starts
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class ChatWorkload:
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...]
    session_rate: float  # sessions started per engine second

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def words_text(rng: np.random.Generator, n_words: int) -> str:
    """``n_words`` words, a punctuation mark every 8-20 words, a capital after each full stop or
    question mark, a full stop at the end."""
    words = _WORD_ARRAY[rng.integers(0, len(WORDS), size=n_words)]
    ends = np.cumsum(rng.integers(8, 21, size=n_words // 8 + 1)) - 1
    ends = ends[ends < n_words - 1]
    marks = _PUNCTUATION_ARRAY[rng.integers(0, len(PUNCTUATION), size=ends.size)]
    words[ends] += marks
    words[-1] += "."
    starts = np.concatenate(([0], ends[(marks == ".") | (marks == "?")] + 1))
    words[starts] = [w.capitalize() for w in words[starts]]
    return " ".join(words)


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    return int(np.clip(round(rng.lognormal(math.log(median), sigma)), bounds[0], bounds[1]))


def build_workload(seed: int, sessions: int, session_rate: float, cfg: ChatConfig = ChatConfig()) -> ChatWorkload:
    """``sessions`` conversations starting as a Poisson process of ``session_rate`` per engine second.

    Every draw comes from a generator keyed by (seed, purpose[, session]), so a conversation's
    text does not depend on how many others are built.
    """
    if sessions < 1 or session_rate <= 0:
        raise ValueError("need at least one session and a positive session rate")
    sys_rng = np.random.default_rng([seed, 0])
    system = tuple(
        words_text(sys_rng, int(sys_rng.integers(cfg.system_words[0], cfg.system_words[1] + 1)))
        for _ in range(cfg.system_prompts)
    )
    starts = np.cumsum(np.random.default_rng([seed, 1]).exponential(1.0 / session_rate, size=sessions))
    starts -= starts[0]  # the first conversation opens the run
    conversations = []
    for s in range(sessions):
        rng = np.random.default_rng([seed, 2, s])
        system_idx = int(rng.integers(cfg.system_prompts))
        turns = []
        for t in range(int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))):
            if t == 0:
                n = _lognormal_int(rng, cfg.first_message_median, cfg.first_message_sigma, cfg.first_message_bounds)
                think = 0.0
            else:
                n = _lognormal_int(rng, cfg.message_median, cfg.message_sigma, cfg.message_bounds)
                think = min(cfg.think_min_s + float(rng.exponential(cfg.think_mean_s)), cfg.think_max_s)
            reply = int(rng.integers(cfg.reply_tokens[0], cfg.reply_tokens[1] + 1))
            turns.append(Turn(words_text(rng, n), reply, think))
        conversations.append(Conversation(f"session-{seed}-{s}", system_idx, float(starts[s]), tuple(turns)))
    return ChatWorkload(system, tuple(conversations), session_rate)


@dataclass(frozen=True)
class ConversationChat:
    """The demo's `conversation` workload: the simulator's production-like shape
    (`kvroute.bench.workloads.ConversationConfig`: heavy-tailed contexts, system prompts of several sizes
    with Zipf popularity, lognormal turns and think times, bursty starts) in words, fitted to a
    demo: contexts under the emulated replicas' 32k-token context, at most 12 turns, and users
    who leave after `think_max_s` (a pass lasts as long as its slowest conversation)."""

    shape: ConversationConfig = ConversationConfig(
        first_message=LogNormal(800, 1.5, 16, 16000),
        turns=LogNormal(3, 1.0, 1, 12),
        max_context_tokens=24000,
    )
    words_per_token: float = 1 / 2.05  # the tiny tokenizer makes about 2.05 tokens of a demo word (measured)
    think_max_s: float = 60.0

    @property
    def mean_turns(self) -> float:
        return self.shape.mean_turns

    def words(self, tokens: int) -> int:
        return max(1, round(tokens * self.words_per_token))


def build_conversation_workload(seed: int, sessions: int, session_rate: float, cfg: ConversationChat = ConversationChat()) -> ChatWorkload:
    """``sessions`` conversations of the `conversation` shape, ``session_rate`` a second on
    average (with its bursts); keyed draws as in `build_workload`."""
    if sessions < 1 or session_rate <= 0:
        raise ValueError("need at least one session and a positive session rate")
    shape = cfg.shape
    sys_rng = np.random.default_rng([seed, 0])
    system = tuple(words_text(sys_rng, cfg.words(n)) for n in shape.system_tokens)
    starts = list(islice(shape.session_starts(seed, 1.0 / session_rate, 0.0), sessions))
    conversations = []
    for s in range(sessions):
        rng = np.random.default_rng([seed, 2, s])
        system_idx = shape.draw_system(rng)
        context = shape.system_tokens[system_idx]
        turns = []
        for t in range(shape.draw_turns(rng)):
            n = shape.draw_message(rng, t)
            reply = shape.draw_reply(rng)
            think = min(shape.draw_think(rng), cfg.think_max_s) if t else 0.0
            context += n + reply
            if shape.max_context_tokens is not None and context > shape.max_context_tokens:
                break
            turns.append(Turn(words_text(rng, cfg.words(n)), reply, think))
        conversations.append(Conversation(f"session-{seed}-{s}", system_idx, starts[s] - starts[0], tuple(turns)))
    return ChatWorkload(system, tuple(conversations), session_rate)


# --- replay -------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    session_id: str
    turn: int
    sent_at: float  # perf_counter seconds
    ttft_s: float = math.nan  # to the first streamed event
    done_at: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # what was sent (for the limit)

    @property
    def ok(self) -> bool:
        return self.error is None


class _Chunk(msgspec.Struct):
    """The parts of an OpenAI stream chunk the replay reads (everything else is skipped)."""

    choices: list[dict] = []
    usage: dict | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode


@dataclass
class Replay:
    """Sends a workload's conversations to ``base_url`` (an OpenAI-compatible server)."""

    base_url: str
    model: str
    workload: ChatWorkload
    time_scale: float  # wall seconds per engine second
    request_timeout_s: float = 120.0
    on_done: Callable[[RequestRecord], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)

    async def run(self) -> list[RequestRecord]:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for conv in self.workload.conversations:
                    tg.create_task(self._conversation(session, conv, t0))
        return self.records

    async def _conversation(self, session: aiohttp.ClientSession, conv: Conversation, t0: float) -> None:
        delay = t0 + conv.start_s * self.time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        messages: list[dict[str, str]] = [{"role": "system", "content": self.workload.system_prompts[conv.system]}]
        for k, turn in enumerate(conv.turns):
            if turn.think_s:
                await asyncio.sleep(turn.think_s * self.time_scale)
            messages.append({"role": "user", "content": turn.user_text})
            record, reply = await self._send(session, conv.session_id, k, messages, turn.max_tokens)
            self.records.append(record)
            if self.on_done is not None:
                self.on_done(record)
            # A failed turn leaves the history (the chat template wants user and assistant turns to
            # alternate): the conversation goes on from the last answered turn.
            if record.ok:
                messages.append({"role": "assistant", "content": reply})
            else:
                messages.pop()

    async def _send(
        self, session: aiohttp.ClientSession, session_id: str, turn: int, messages: Sequence[dict[str, str]], max_tokens: int
    ) -> tuple[RequestRecord, str]:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        record = RequestRecord(session_id, turn, time.perf_counter(), messages=list(messages))
        reply = await stream_chat(session, self.base_url, body, {"X-Session-ID": session_id}, record)
        return record, reply


async def stream_chat(
    session: aiohttp.ClientSession, base_url: str, body: dict, headers: Mapping[str, str], record: RequestRecord
) -> str:
    """POST a streaming chat completion (usage requested), filling ``record`` as it goes: TTFT at
    the first streamed event (from ``record.sent_at``), the usage chunk's token counts, any error.
    Returns the reply's text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    try:
        async with session.post(
            base_url + "/v1/chat/completions", data=_encode(body), headers={"Content-Type": "application/json", **headers}
        ) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                record.done_at = time.perf_counter()
                return ""
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if math.isnan(record.ttft_s):
                    record.ttft_s = time.perf_counter() - record.sent_at
                if payload == b"[DONE]":
                    # Read on to the end of the response, as the OpenAI SDK does: hanging up at
                    # [DONE] can cut the server's last write (the chunked-encoding terminator).
                    continue
                chunk = _decode_chunk(payload)
                if chunk.error is not None:
                    record.error = f"in-stream error: {chunk.error.get('message')}"
                    break
                for choice in chunk.choices:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        parts.append(text)
                if chunk.usage is not None:
                    record.prompt_tokens = int(chunk.usage.get("prompt_tokens") or 0)
                    record.completion_tokens = int(chunk.usage.get("completion_tokens") or 0)
                    details = chunk.usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = int(details.get("cached_tokens") or 0)
        if record.error is None and record.prompt_tokens == 0:
            record.error = "the stream ended without a usage chunk"
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.done_at = time.perf_counter()
    return "".join(parts)
