"""`kvroute bench replay`: replay a Mooncake-format trace against any OpenAI-compatible endpoint.

A trace row is `{timestamp (ms), input_length, output_length, hash_ids}`, one hash id per
512-token block of the prompt; equal leading ids are shared prefixes (bench/data/README.md).
Each row becomes one streaming chat request, sent open loop at its timestamp (divided by
`--speedup`), whatever the earlier ones are doing (`--start`/`--limit` pick a slice);
`max_tokens` is its output length (capped by `--max-tokens`).

Prompts are text, sent as chat: every endpoint takes it (kvroute, a peer router that matches
on text, a single vLLM), and the router under test does its real work (chat template,
tokenizer).  Each hash id becomes a fixed run of common English words drawn from a generator
seeded by the id, ended by a newline, so equal id prefixes are equal text prefixes and, since no
token spans the newline, equal token prefixes through any BPE tokenizer.  The words per block
are calibrated once against the endpoint's `/tokenize` (vLLM's, which kvroute passes to a
replica) so that a block is about 512 tokens; without it, one token per word is assumed.
(Completions with token-id prompts would hit 512 tokens exactly, but a router or replica
that routes on text would see none of it, and ids must fit the served vocabulary.)

Figures: TTFT (request sent to the first streamed event) p50/p90/p99 over answered requests;
errors; reuse available, from the hash ids over the replayed slice (the leading blocks some
earlier request of the slice had, as tokens, over the trace's input tokens: what one infinite
cache shared by the fleet would hit); reuse delivered, the endpoint's
`usage.prompt_tokens_details.cached_tokens` over its `prompt_tokens`.  With `--profile`
(the replicas' timing profile, and `--replica-time-scale` if they run faster than real time),
also the physical limit (bench/limit.py) and TTFT percentiles as multiples of it; the limit
takes each request's `prompt_tokens` and its available tokens, in the replicas' blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import aiohttp
import numpy as np

from kvroute.bench.demo_chat import WORDS, RequestRecord, stream_chat
from kvroute.bench.limit import LIMIT_KEYS, available_blocks, limit_ttfts, multiples, percentiles
from kvroute.bench.sim_cli import resolve_profile
from kvroute.bench.workloads import DEFAULT_TRACE, DEFAULT_TRACE_NAME, TRACE_BLOCK_TOKENS, load_trace

TEXT_SEED = 512  # the words of a block: a generator keyed by (TEXT_SEED, hash id)
CALIBRATION_WORDS = 400


@lru_cache(maxsize=65536)
def block_words(hash_id: int, words: int) -> tuple[str, ...]:
    """The words of one trace block (a prefix of them for a partial last block)."""
    rng = np.random.default_rng([TEXT_SEED, hash_id])
    return tuple(WORDS[i] for i in rng.integers(0, len(WORDS), size=words))


def prompt_text(row: dict, words_per_block: int) -> str:
    """The row's prompt: one newline-ended run of words per hash id, the last one cut in
    proportion to the row's input length."""
    ids = row["hash_ids"]
    last_tokens = int(row["input_length"]) - TRACE_BLOCK_TOKENS * (len(ids) - 1)
    parts = []
    for k, h in enumerate(ids):
        words = block_words(int(h), words_per_block)
        if k == len(ids) - 1 and 0 < last_tokens < TRACE_BLOCK_TOKENS:
            words = words[: max(1, round(words_per_block * last_tokens / TRACE_BLOCK_TOKENS))]
        parts.append(" ".join(words) + "\n")
    return "".join(parts)


def available_tokens(rows: Sequence[dict]) -> np.ndarray:
    """Per row, the prompt tokens an earlier row of the slice already had (leading shared ids)."""
    blocks = available_blocks([r["hash_ids"] for r in rows])
    return np.array([min(m * TRACE_BLOCK_TOKENS, int(r["input_length"])) for m, r in zip(blocks, rows)], dtype=np.int64)


async def calibrate(session: aiohttp.ClientSession, url: str, model: str) -> float | None:
    """Tokens per word of block text through the endpoint's tokenizer (`/tokenize`), or None."""
    counts = []
    for n in (CALIBRATION_WORDS, 2 * CALIBRATION_WORDS):
        text = " ".join(block_words(0, n)) + "\n"
        try:
            async with session.post(url + "/tokenize", json={"model": model, "prompt": text}) as resp:
                if resp.status != 200:
                    return None
                doc = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        counts.append(int(doc.get("count") or len(doc.get("tokens") or ())))
    per_word = (counts[1] - counts[0]) / CALIBRATION_WORDS  # the difference drops BOS and the like
    return per_word if per_word > 0 else None


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        models = (await resp.json()).get("data") or []
    if not models:
        raise SystemExit(f"kvroute bench replay: {url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


@dataclass
class ReplayResult:
    rows: list[dict]
    records: list[RequestRecord]  # in row order
    wall_s: float
    words_per_block: int
    tokens_per_word: float | None  # None: not calibrated


class Replayer:
    def __init__(self, args: argparse.Namespace, rows: list[dict]):
        self.args = args
        self.rows = rows

    async def run(self, on_done: Any = None) -> ReplayResult:
        args = self.args
        url = args.url.rstrip("/")
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            model = args.model or await served_model(session, url)
            per_word = await calibrate(session, url, model)
            words = max(1, round((TRACE_BLOCK_TOKENS - 1) / (per_word or 1.0)))  # -1: the newline
            records = [RequestRecord(session_key(r), i, math.nan) for i, r in enumerate(self.rows)]
            t_first = self.rows[0]["timestamp"]
            start = time.perf_counter()

            async def one(i: int) -> None:
                row = self.rows[i]
                delay = start + (row["timestamp"] - t_first) / 1000.0 / args.speedup - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                out = max(1, int(row["output_length"]))
                # Built when due (a whole trace's text would not fit in memory), before the clock
                # of its TTFT starts: block texts are cached, so this takes about a millisecond.
                body = {"model": model, "messages": [{"role": "user", "content": prompt_text(row, words)}],
                        "max_tokens": min(out, args.max_tokens) if args.max_tokens else out}
                headers = {args.session_header: records[i].session_id} if args.session_header else {}
                records[i].sent_at = time.perf_counter()
                await stream_chat(session, url, body, headers, records[i])
                if on_done is not None:
                    on_done(records[i])

            async with asyncio.TaskGroup() as tg:
                for i in range(len(self.rows)):
                    tg.create_task(one(i))
            wall = time.perf_counter() - start
        return ReplayResult(self.rows, records, wall, words, per_word)


def session_key(row: dict) -> str:
    """The trace has no session ids: rows that start with the same block are one conversation."""
    return f"trace-{row['hash_ids'][0]}" if row["hash_ids"] else "trace-empty"


def summarize(result: ReplayResult, profile: Any = None, replica_time_scale: float = 1.0) -> dict[str, Any]:
    ok = [i for i, r in enumerate(result.records) if r.ok]
    recs = result.records
    ttft = np.array([recs[i].ttft_s for i in ok])
    avail = available_tokens(result.rows)
    input_tokens = sum(int(r["input_length"]) for r in result.rows)
    prompt = sum(recs[i].prompt_tokens for i in ok)
    cached = sum(recs[i].cached_tokens for i in ok)
    errors = [r.error for r in recs if not r.ok]
    out: dict[str, Any] = {
        "requests": len(recs),
        "answered": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        **percentiles(ttft),
        "reuse_available": float(avail.sum() / input_tokens) if input_tokens else math.nan,
        "reuse_delivered": cached / prompt if prompt else math.nan,
        "input_tokens": input_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": sum(recs[i].completion_tokens for i in ok),
        "wall_s": round(result.wall_s, 2),
        "words_per_block": result.words_per_block,
        "tokens_per_word": result.tokens_per_word,
    }
    out["delivered_share_of_available"] = (
        out["reuse_delivered"] / out["reuse_available"] if out["reuse_available"] else math.nan
    )
    out["limit"] = None
    if profile is not None and ok:
        bs = profile.block_size
        prompts = [recs[i].prompt_tokens for i in ok]
        seen = [min(int(avail[i]), p) // bs for i, p in zip(ok, prompts)]
        out["limit"] = percentiles(limit_ttfts(profile, prompts, seen, bs) * replica_time_scale)
        out["ttft_vs_limit"] = multiples(out, out["limit"])
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvroute bench replay", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=DEFAULT_TRACE, metavar="FILE",
                   help="Mooncake-format JSONL, gzipped or not (timestamp ms, input_length, output_length, hash_ids; "
                   f"default: {DEFAULT_TRACE_NAME})")
    p.add_argument("--url", required=True, help="the endpoint's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--speedup", type=float, default=1.0, help="divide the trace's timestamps by this (default 1: real time)")
    p.add_argument("--start", type=int, default=0, help="skip the trace's first K requests (default 0)")
    p.add_argument("--limit", type=int, default=None, help="replay N requests (default: all)")
    p.add_argument("--session-header", default=None, metavar="NAME",
                   help="send a session id in this header (e.g. X-Session-ID): the row's first hash id")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens (default: the trace's output_length)")
    p.add_argument("--profile", default=None, help="the replicas' timing profile (replica/emulated/profile.py): report the physical limit")
    p.add_argument("--replica-time-scale", type=float, default=1.0,
                   help="with --profile: wall seconds per engine second of the replicas (emulated --time-scale; default 1)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    if args.speedup <= 0 or args.replica_time_scale <= 0:
        p.error("--speedup and --replica-time-scale must be positive")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    if args.start < 0:
        p.error("--start must not be negative")
    return args


def print_summary(figures: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvroute.bench.report import pct, secs, secs_vs

    limit = figures["limit"]
    table = Table(title=title)
    for col in ("requests", "errors", "available", "delivered", "deliv/avail", "TTFT p50", "TTFT p90", "TTFT p99"):
        table.add_column(col, justify="right")
    table.add_row(
        str(figures["requests"]), str(figures["errors"]), pct(figures["reuse_available"]), pct(figures["reuse_delivered"]),
        pct(figures["delivered_share_of_available"]),
        *(secs_vs(figures[k], None if limit is None else limit[k]) for k in LIMIT_KEYS),
    )
    if limit is not None:
        table.caption = "physical limit: " + ", ".join(f"p{k[6:8]} {secs(limit[k])}" for k in LIMIT_KEYS) + "; (Nx) = over the limit's"
    Console(width=140).print(table)
    if figures["first_error"]:
        print(f"first error: {figures['first_error']}")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    profile = None if args.profile is None else resolve_profile(args.profile, "kvroute bench replay")
    rows = load_trace(args.trace)[args.start :][: args.limit]
    if not rows:
        raise SystemExit(f"kvroute bench replay: no requests in {args.trace}")
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 / args.speedup
    err = Console(stderr=True)
    err.print(f"replaying {len(rows)} requests of {args.trace} over {span:.0f} s (speedup {args.speedup:g}) against {args.url}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[errors]} errors"), console=err) as bar:
        task = bar.add_task("answered", total=len(rows), errors=0)
        failed = [0]

        def done(record: RequestRecord) -> None:
            failed[0] += not record.ok
            bar.update(task, advance=1, errors=failed[0])

        result = asyncio.run(Replayer(args, rows).run(done))
    figures = summarize(result, profile, args.replica_time_scale)
    if result.tokens_per_word is None:
        err.print("[yellow]the endpoint has no /tokenize: one token per word assumed (blocks may not be 512 tokens)[/]")
    if args.json:
        from kvroute.bench.report import json_safe

        extra = {"trace": str(args.trace), "start": args.start, "url": args.url, "speedup": args.speedup,
                 "session_header": args.session_header}
        sys.stdout.write(json.dumps(json_safe({**figures, **extra})) + "\n")
    else:
        print_summary(figures, f"kvroute bench replay: {len(rows)} requests, speedup {args.speedup:g}, {args.url}")
    return 1 if figures["answered"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
