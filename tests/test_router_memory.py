"""A huge prompt through the real router: refused early (over the model's context) and its memory
given back; before, one 15 MB prompt was tokenized whole for 48 s and left +1.2 GB of RSS."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp
import pytest

from tests.router_support import MODEL, emulated_replicas, running_router

PROMPT_BYTES = 15_000_000


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _huge_text() -> bytes:
    rng = random.Random(7)
    words = [b"hello", b"world", b"the", b"router", b"cache", b"token", b"block", b"prefix", b"tokyo", b"zurich"]
    text = b" ".join(rng.choice(words) for _ in range(PROMPT_BYTES // 6 + 1))
    return text[:PROMPT_BYTES]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read RSS and reset its peak")
async def test_a_15_mb_prompt_is_refused_fast_and_its_memory_given_back():
    text = _huge_text()
    bodies = {
        "/v1/completions": b'{"model": "%s", "max_tokens": 1, "prompt": "%s"}' % (MODEL.encode(), text),
        "/v1/chat/completions": b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "%s"}]}'
        % (MODEL.encode(), text),
    }
    del text
    async with emulated_replicas(1) as reps, running_router([reps[0].url]) as app:
        async with aiohttp.ClientSession() as session:
            async with session.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1}) as r:
                assert r.status == 200
        before_kb = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM (peak RSS) restarts from now
        # (a connection of its own each: aiohttp keeps a keep-alive connection's last request,
        # body included, until the next one arrives or the connection closes)
        for path, body in bodies.items():
            started = time.perf_counter()
            async with aiohttp.ClientSession() as session:
                async with session.post(app.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    answer = await r.json()
            assert r.status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
            assert "more than the limit of 32768" in answer["error"]["message"]  # the replica's max_model_len
            assert time.perf_counter() - started < 15  # generous: ~0.5 s here, 48 s when tokenized whole
        await asyncio.sleep(0.2)  # the server side of the connections closes
        peak_mb = (_status_kb("VmHWM") - before_kb) / 1024
        after_mb = (_status_kb("VmRSS") - before_kb) / 1024
    # In flight, the router holds the body as bytes, the decoded str and a validated copy (and the
    # chat its rendered prompt): ~4-5x the prompt; 10x (150 MB) leaves room for allocator slack.
    assert peak_mb < 10 * PROMPT_BYTES / 1e6, f"peak RSS +{peak_mb:.0f} MB during two 15 MB prompts"
    # Afterwards, less than the prompt itself stays (buffers over 1 MiB are unmapped when freed).
    assert after_mb < PROMPT_BYTES / 1e6, f"RSS +{after_mb:.0f} MB after two 15 MB prompts"
