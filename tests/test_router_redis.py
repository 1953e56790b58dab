"""Several routers sharing one Redis prefix index: a conversation continued through another
router goes to the replica that holds its prefix."""

from __future__ import annotations


from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape, total, label

SYSTEM = "Instructions shared by the whole conversation, long enough to fill many blocks. " * 10


async def test_two_routers_route_one_session_to_the_same_replica(redis_url, redis_prefix):
    async with emulated_replicas(4) as reps:
        urls = [r.url for r in reps]
        common = {"redis_url": redis_url, "redis_key_prefix": redis_prefix}
        async with running_router(urls, **common) as one, running_router(urls, **common) as two:
            clients = [openai_client(app, "x") for app in (one, two)]
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Turn zero?"}]
            cached = []
            for turn in range(6):  # alternate routers turn by turn
                resp = await clients[turn % 2].chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=4, extra_headers={"X-Session-ID": "s-1"}
                )
                details = resp.usage.prompt_tokens_details
                cached.append(details.cached_tokens if details else 0)
                msgs += [{"role": "assistant", "content": resp.choices[0].message.content},
                         {"role": "user", "content": f"Turn {turn + 1}?"}]

            used = set()
            for app in (one, two):
                samples = await scrape(app.url)
                used |= {url for url in urls if total(samples, "kvroute_requests_total", replica=label(url)) > 0}
                # each router found the other's predictions in Redis
                assert total(samples, "kvroute_routing_decisions_total", reason="cache") >= 2
                assert total(samples, "kvroute_index_errors_total") == 0
            assert len(used) == 1
            assert cached[0] == 0 and all(c > 0 for c in cached[1:])


async def test_unreachable_redis_degrades_to_load_balancing():
    from tests.conftest import free_port

    async with emulated_replicas(2) as reps:
        dead_redis = f"redis://127.0.0.1:{free_port()}/0"
        async with running_router([r.url for r in reps], redis_url=dead_redis, index_timeout_s=0.5) as app:
            client = openai_client(app, "x")
            for i in range(3):
                prompt = f"still routing {i} " + "with a prompt long enough to fill blocks " * 8
                resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
                assert resp.choices
            samples = await scrape(app.url)
            assert total(samples, "kvroute_index_errors_total", op="lookup") == 3
            assert total(samples, "kvroute_requests_total", status="200") == 3
