"""Chat templates through the real router: a client's own template is refused unless enabled, and
then renders in a worker process within its budgets while the event loop stays free."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import openai
import pytest

from kvroute.replica import tiny_model
from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape, total

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a prefix cache? " * 8}]
BOMB = "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"


async def _chat(client: openai.AsyncOpenAI, **extra_body) -> openai.types.chat.ChatCompletion:
    return await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra_body or None)


async def _routed_prompt_tokens(app, before: float) -> float:
    """The router's own count of the last request's prompt tokens (booked just after the answer)."""
    for _ in range(100):
        now = total(await scrape(app.url), "kvroute_prompt_tokens_total")
        if now != before:
            return now - before
        await asyncio.sleep(0.02)
    raise AssertionError("the router booked no prompt tokens")


async def test_client_template_is_refused_unless_enabled():
    async with emulated_replicas(1) as reps, running_router([reps[0].url]) as app:
        client = openai_client(app)
        with pytest.raises(openai.BadRequestError) as err:
            await _chat(client, chat_template=tiny_model.CHAT_TEMPLATE)
        body = err.value.body
        assert err.value.status_code == 400 and body["param"] == "chat_template"
        assert body["code"] == "client_chat_template_disabled" and "--allow-client-chat-template" in body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            await _chat(client, chat_template=["not", "a", "string"])
        assert err.value.body["param"] == "chat_template"
        # chat_template_kwargs cannot smuggle one in: the model's template renders (exactly the
        # replica's prompt), not the smuggled one, which would render a single character
        before = total(await scrape(app.url), "kvroute_prompt_tokens_total")
        answer = await _chat(client, chat_template_kwargs={"chat_template": "x"})
        assert await _routed_prompt_tokens(app, before) == answer.usage.prompt_tokens > 20


async def test_enabled_client_template_renders_in_a_worker_within_budget():
    budget = 0.5
    async with emulated_replicas(1) as reps, running_router(
        [reps[0].url], allow_client_chat_template=True, client_chat_template_timeout_s=budget,
        client_chat_template_max_chars=100_000,
    ) as app:
        client = openai_client(app)
        # the model's own template sent as the client's renders the same prompt the replica renders
        before = total(await scrape(app.url), "kvroute_prompt_tokens_total")
        answer = await _chat(client, chat_template=tiny_model.CHAT_TEMPLATE)
        assert await _routed_prompt_tokens(app, before) == answer.usage.prompt_tokens
        # and a different template is the one the router rendered: two contents, no markup
        before = total(await scrape(app.url), "kvroute_prompt_tokens_total")
        answer = await _chat(client, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
        assert 0 < await _routed_prompt_tokens(app, before) < answer.usage.prompt_tokens

        # the bomb: refused once over budget, while /health, sampled every 20 ms, stays prompt
        latencies: list[float] = []
        done = asyncio.Event()

        async def sample_health(session: aiohttp.ClientSession) -> None:
            while not done.is_set():
                started = time.perf_counter()
                async with session.get(app.url + "/health") as r:
                    assert r.status == 200
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)

        async with aiohttp.ClientSession() as session:
            sampler = asyncio.create_task(sample_health(session))
            started = time.perf_counter()
            try:
                with pytest.raises(openai.BadRequestError) as err:
                    await _chat(client, chat_template=BOMB)
            finally:
                elapsed = time.perf_counter() - started
                done.set()
                await sampler
        assert err.value.body["code"] == "chat_template_timeout" and err.value.body["param"] == "chat_template"
        assert budget <= elapsed < budget + 5  # generous: a loaded machine
        # before, /health stalled for the whole render (9-17 s); bounds generous for a loaded machine
        latencies.sort()
        assert len(latencies) >= 10, latencies
        assert latencies[len(latencies) // 2] < 0.05 and latencies[-1] < 1.0, f"/health took up to {latencies[-1] * 1000:.0f} ms"

        # over the output budget: refused as such
        with pytest.raises(openai.BadRequestError) as err:
            await _chat(client, chat_template="{% for i in range(50000) %}{{ 'xxxxxxxxxx' }}{% endfor %}")
        assert err.value.body["code"] == "chat_template_output_too_large"
        # a worker that dies while idle (the OOM killer) is replaced for the next request
        (pid,) = app.tokenizers.client_templates.worker_pids()
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        before = total(await scrape(app.url), "kvroute_prompt_tokens_total")
        answer = await _chat(client, chat_template=tiny_model.CHAT_TEMPLATE)
        assert await _routed_prompt_tokens(app, before) == answer.usage.prompt_tokens
        pids = app.tokenizers.client_templates.worker_pids()
        assert pids and pid not in pids
    for pid in pids:  # the router stopped its workers
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
