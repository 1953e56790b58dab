"""Tokenization cost per request: the router's segment-cached path against plain ``tokenizers``.

    python -m kvroute.bench.tokenize_bench [--tokenizer DIR] [--size 16384] [--iterations 200] [--json]

Cases (each iteration uses a prompt whose new part was never seen before):
  * multi-turn: a ~16 KB chat whose earlier turns the router has seen, plus one short new turn;
  * new chat:   a ~16 KB chat (one long user turn) never seen;
  * new prompt: a ~16 KB completion prompt never seen;
and, for reference, plain ``tokenizers`` encoding of the same rendered strings (no cache).  The
async cases report how late a 1 ms ticker on the event loop wakes while never-seen 16 KB chats are
tokenized with ``aencode_chat`` (thread pool) or with a synchronous ``encode_chat`` on the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.replica.tiny_model import training_corpus
from kvroute.common.tokens import Tokenizer

ASSET = TINY_TOKENIZER


def _text(seed: int, size: int) -> str:
    out, n = [], 0
    for doc in training_corpus(seed, documents=10_000):
        out.append(doc)
        n += len(doc)
        if n >= size:
            break
    return "".join(out)[:size]


def _history(size: int) -> list[dict]:
    """A multi-turn chat of about ``size`` characters: a system prompt and alternating turns."""
    messages = [{"role": "system", "content": _text(1, 1500)}]
    seed = 100
    while sum(len(m["content"]) for m in messages) < size - 200:
        seed += 1
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": _text(seed, 300 if role == "user" else 1200)})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages


def _measure(fn: Callable[[int], Any], iterations: int) -> dict[str, float]:
    """Median and p90 wall time, and mean process CPU time (all threads: tokenizers may use its
    own pool), per call, in microseconds."""
    fn(-1)  # warm-up
    walls = []
    cpu0 = time.process_time()
    for i in range(iterations):
        t0 = time.perf_counter()
        fn(i)
        walls.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / iterations
    walls.sort()
    return {"p50_us": statistics.median(walls) * 1e6, "p90_us": walls[int(len(walls) * 0.9)] * 1e6, "cpu_us": cpu * 1e6}


async def _loop_stalls(work: Callable[[], Any] | None, rounds: int) -> dict[str, float]:
    """How late a 1 ms ticker wakes (µs: p50, p99, max) while ``work`` runs ``rounds`` times
    (or, with no work, for as long: the machine's own noise floor)."""
    lates: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lates.append(now - last - 0.001)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    for _ in range(rounds):
        if work is None:
            await asyncio.sleep(0.01)
            continue
        result = work()
        if asyncio.iscoroutine(result):
            await result
        await asyncio.sleep(0)
    done = True
    await task
    lates.sort()
    return {"p50_us": statistics.median(lates) * 1e6, "p99_us": lates[int(len(lates) * 0.99)] * 1e6, "max_us": lates[-1] * 1e6}


def run(tokenizer_dir: Path, size: int, iterations: int) -> dict[str, Any]:
    tok = Tokenizer.from_dir(tokenizer_dir)
    backend = tok.backend
    history = _history(size)
    rendered_len = len(tok.render_chat(history + [{"role": "user", "content": "What next?"}]))
    tok.encode_chat(history)  # the router has seen the earlier turns
    # Distinct never-seen texts per case (index -1 is the warm-up's).
    chat_texts = [_text(10_000 + i, size) for i in range(-1, iterations)]
    prompt_texts = [_text(20_000 + i, size) for i in range(-1, iterations)]

    def turn(i: int) -> list[dict]:
        return history + [{"role": "user", "content": f"And what about question {i}?"}]

    def new_chat(i: int) -> list[dict]:
        return [{"role": "user", "content": chat_texts[i + 1]}]

    rendered_turn = tok.render_chat(turn(0))
    results: dict[str, Any] = {
        "tokenizer": str(tokenizer_dir),
        "multi_turn_chars": rendered_len,
        "multi_turn_tokens": len(tok.encode_chat(turn(0))),
        "new_prompt_chars": size,
        "new_prompt_tokens": len(tok.backend.encode(prompt_texts[0]).ids),
        "iterations": iterations,
        "cases": {},
    }
    cases = results["cases"]
    kb = f"{size // 1024}KB"
    cases["multi_turn: render_chat only"] = _measure(lambda i: tok.render_chat(turn(i)), iterations)
    cases["multi_turn: encode_chat (cached turns)"] = _measure(lambda i: tok.encode_chat(turn(i)), iterations)
    cases["multi_turn: plain tokenizers.encode of rendered"] = _measure(
        lambda i: backend.encode(rendered_turn, add_special_tokens=False).ids, iterations)
    cases["multi_turn: plain encode_batch_fast of rendered"] = _measure(
        lambda i: backend.encode_batch_fast([rendered_turn], add_special_tokens=False)[0].ids, iterations)
    cases[f"new {kb} chat: encode_chat (uncached)"] = _measure(lambda i: tok.encode_chat(new_chat(i)), iterations)
    cases[f"new {kb} prompt: encode_prompt (uncached)"] = _measure(lambda i: tok.encode_prompt(prompt_texts[i + 1]), iterations)
    cases[f"new {kb} prompt: plain tokenizers.encode"] = _measure(lambda i: backend.encode(prompt_texts[i + 1]).ids, iterations)
    stats = tok.cache.stats()
    results["cache"] = {"entries": stats.entries, "chars": stats.chars, "hits": stats.hits, "misses": stats.misses}

    async def stalls() -> dict[str, dict[str, float]]:
        rounds = min(iterations, 40)
        fresh = iter(range(50_000, 60_000))

        def unseen() -> list[dict]:  # a chat no earlier request shares a segment with
            return [{"role": "user", "content": str(next(fresh)) + chat_texts[0]}]

        return {
            "idle (noise floor)": await _loop_stalls(None, rounds),
            f"new {kb} chat, aencode_chat (pool)": await _loop_stalls(lambda: tok.aencode_chat(unseen()), rounds),
            f"new {kb} chat, encode_chat on the loop": await _loop_stalls(lambda: tok.encode_chat(unseen()), rounds),
            "multi-turn, aencode_chat (inline fast path)": await _loop_stalls(lambda: tok.aencode_chat(turn(next(fresh))), rounds),
        }

    results["event_loop_lateness"] = asyncio.run(stalls())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.bench.tokenize_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=ASSET, help="tokenizer directory (default: the tiny test tokenizer)")
    parser.add_argument("--size", type=int, default=16_384, help="prompt size in characters")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = run(args.tokenizer, args.size, args.iterations)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"tokenizer {results['tokenizer']}")
    print(f"multi-turn chat: {results['multi_turn_chars']} chars, {results['multi_turn_tokens']} tokens; "
          f"new prompt: {results['new_prompt_chars']} chars, {results['new_prompt_tokens']} tokens; {results['iterations']} iterations")
    print(f"{'case':52} {'p50 µs':>9} {'p90 µs':>9} {'CPU µs':>9}")
    for name, m in results["cases"].items():
        print(f"{name:52} {m['p50_us']:9.0f} {m['p90_us']:9.0f} {m['cpu_us']:9.0f}")
    print(f"{'event-loop lateness of a 1 ms ticker':52} {'p50 µs':>9} {'p99 µs':>9} {'max µs':>9}")
    for name, m in results["event_loop_lateness"].items():
        print(f"  {name:50} {m['p50_us']:9.0f} {m['p99_us']:9.0f} {m['max_us']:9.0f}")
    print(f"segment cache: {results['cache']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
