"""Late binding through the real router (docs/design.md §5.9): emulated replicas whose prefill
queue is full hold nothing more; the router holds the requests (not sent) and sends each when its
replica has room, or when ``hold_max_s`` is spent; every request is answered."""

from __future__ import annotations

import asyncio
import time

from kvroute.bench.chat_text import chat_text
from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape

# ~3k-token prompts, each new: at time scale 20 one prefill takes ~2 s of wall time
PROMPT_CHARS = 6_000


def prompt(i: int) -> str:
    return f"request {i}: " + chat_text((i, 7), PROMPT_CHARS)


async def chat(app, i: int) -> str:
    stream = await openai_client(app).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt(i)}], max_tokens=2, stream=True
    )
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def in_engines(reps) -> int:
    """Requests the replicas hold (waiting or running): what the router sent and is not done."""
    return sum(r.engine.num_running + r.engine.num_waiting for r in reps)


async def sample_while(task: asyncio.Future, app, reps) -> list[tuple[int, int]]:
    """(held at the router, held by the replicas) every 20 ms until ``task`` is done."""
    samples = []
    while not task.done():
        samples.append((app.holds.waiting if app.holds is not None else 0, in_engines(reps)))
        await asyncio.sleep(0.02)
    return samples


async def hold_waits(app) -> dict[str, dict[float, float]]:
    """kvroute_hold_wait_seconds' buckets from the router's /metrics, by how the hold ended: {ended: {le: count}}."""
    out: dict[str, dict[float, float]] = {}
    for (name, labels), value in (await scrape(app.url)).items():
        if name == "kvroute_hold_wait_seconds_bucket":
            got = dict(labels)
            out.setdefault(got["ended"], {})[float(got["le"])] = value
    return out


async def test_requests_wait_at_the_router_while_every_replica_is_full_and_go_when_one_has_room():
    n = 6
    async with emulated_replicas(2, time_scale=20.0) as reps, running_router(
        [r.url for r in reps], hold_max_s=60.0, hold_queued_tokens=1
    ) as app:
        started = time.monotonic()
        answers = asyncio.gather(*(chat(app, i) for i in range(n)))
        samples = await sample_while(answers, app, reps)
        texts = await answers
        took = time.monotonic() - started
        waits = await hold_waits(app)
    assert all(texts), "every request answered"
    # while requests were held, the replicas held at most one prefill each (plus a finishing answer)
    held = [(h, e) for h, e in samples if h >= n - 2]
    assert held, f"requests were never held at the router: {samples[:20]}"
    assert max(e for _, e in held) <= 2, held
    assert max(h + e for h, e in samples) <= n  # nothing lost, nothing counted twice
    assert set(waits) == {"room"}, waits  # each left the line because its replica had room
    assert waits["room"][float("inf")] >= n - 2
    assert took < 60.0


async def test_a_held_request_is_sent_when_its_budget_is_spent():
    n, budget = 4, 0.5
    async with emulated_replicas(1, time_scale=40.0) as reps, running_router(
        [r.url for r in reps], hold_max_s=budget, hold_queued_tokens=1
    ) as app:
        answers = asyncio.gather(*(chat(app, i) for i in range(n)))
        samples = await sample_while(answers, app, reps)
        texts = await answers
        waits = await hold_waits(app)
    assert all(texts), "every request answered"
    assert any(h == n - 1 for h, _ in samples), samples[:20]  # held at first...
    assert any(e == n for _, e in samples)  # ...then all sent, while the first prefill still ran
    assert waits.get("budget", {}).get(float("inf")) == n - 1, waits
    # none held much past the budget (a loaded machine delays a timer by a little, not seconds)
    assert waits["budget"][2.5] == n - 1, waits
