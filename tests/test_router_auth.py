"""Client API keys, the admin token and its endpoints, tenant isolation through cache_salt."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape, total, label

MSGS = [{"role": "system", "content": "Shared instructions for every tenant. " * 20}, {"role": "user", "content": "Hi"}]


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_client_keys_enforced_on_api_not_on_probes():
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url], api_keys=["key-one", "key-two"]) as app:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "messages": MSGS, "max_tokens": 1}
                for headers in ({}, _bearer("wrong"), {"Authorization": "Basic a2V5LW9uZQ=="}):
                    async with s.post(app.url + "/v1/chat/completions", json=body, headers=headers) as r:
                        err = (await r.json())["error"]
                        assert r.status == 401 and err["code"] == "invalid_api_key"
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                async with s.get(app.url + "/v1/models") as r:
                    assert r.status == 401
                for path in ("/health", "/ready", "/metrics"):
                    async with s.get(app.url + path) as r:
                        assert r.status == 200, path
            client = openai_client(app, "key-two")
            assert (await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)).choices
            with pytest.raises(openai.AuthenticationError):
                await openai_client(app, "nope").models.list()


async def test_admin_disabled_without_token():
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url]) as app:
            async with aiohttp.ClientSession() as s, s.get(app.url + "/admin/replicas", headers=_bearer("x")) as r:
                assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"


async def test_admin_token_lists_and_drains_replicas():
    async with emulated_replicas(2) as reps:
        async with running_router([r.url for r in reps], admin_token="adm1n", api_keys=["client"]) as app:
            admin = _bearer("adm1n")
            async with aiohttp.ClientSession() as s:
                for headers in ({}, _bearer("client")):  # a client key is not the admin token
                    async with s.get(app.url + "/admin/replicas", headers=headers) as r:
                        assert r.status == 401
                async with s.get(app.url + "/admin/replicas", headers=admin) as r:
                    listed = (await r.json())["replicas"]
                    assert r.status == 200 and {x["name"] for x in listed} == {rep.url for rep in reps}
                    assert all(x["healthy"] and not x["draining"] for x in listed)
                async with s.post(app.url + "/admin/replicas/drain", json={"replica": reps[0].url}, headers=admin) as r:
                    assert r.status == 200
                async with s.post(app.url + "/admin/replicas/drain", json={"replica": "http://x:1"}, headers=admin) as r:
                    assert r.status == 404 and (await r.json())["error"]["code"] == "replica_not_found"

                client = openai_client(app, "client")
                for i in range(4):
                    await client.completions.create(model=MODEL, prompt=f"prompt {i}", max_tokens=1)
                samples = await scrape(app.url)
                assert total(samples, "kvroute_requests_total", replica=label(reps[0].url)) == 0
                assert total(samples, "kvroute_requests_total", replica=label(reps[1].url)) == 4

                async with s.post(app.url + "/admin/replicas/drain", json={"replica": reps[1].url}, headers=admin) as r:
                    assert r.status == 200
                with pytest.raises(openai.InternalServerError) as info:
                    await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
                assert info.value.status_code == 503
                async with s.get(app.url + "/ready") as r:
                    assert r.status == 503
                async with s.post(app.url + "/admin/replicas/undrain", json={"replica": reps[1].url}, headers=admin) as r:
                    assert r.status == 200
                assert (await client.completions.create(model=MODEL, prompt="x", max_tokens=1)).choices


async def test_tenant_isolation_separates_caches():
    async with emulated_replicas(1) as reps:
        async with running_router([reps[0].url], api_keys=["tenant-a", "tenant-b"], tenant_isolation=True) as app:
            a = openai_client(app, "tenant-a")
            b = openai_client(app, "tenant-b")

            async def cached(client: openai.AsyncOpenAI, **extra) -> int:
                resp = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, **extra)
                details = resp.usage.prompt_tokens_details
                return details.cached_tokens if details else 0

            assert await cached(a) == 0
            assert await cached(a) > 0  # the same tenant reuses its own prefix
            assert await cached(b) == 0  # the other tenant cannot hit it, even with the same prompt
            assert await cached(b, extra_body={"cache_salt": "guess"}) == 0  # nor by choosing a salt
            assert await cached(b) > 0
            samples = await scrape(app.url)
            # predictions follow the salts too: the router never believed b could hit a's blocks
            assert total(samples, "kvroute_reuse_predicted_tokens_total") == total(
                samples, "kvroute_reuse_delivered_tokens_total"
            )


async def test_replica_key_is_the_routers_own_not_the_clients():
    async with emulated_replicas(1, api_key="replica-secret") as (rep,):
        async with running_router([rep.url], api_keys=["client-key"], fleet={"replica_api_key": "replica-secret"}) as app:
            resp = await openai_client(app, "client-key").completions.create(model=MODEL, prompt="hi", max_tokens=1)
            assert resp.choices
        async with running_router([rep.url]) as keyless:  # without it the replica refuses the router
            with pytest.raises(openai.APIStatusError) as refused:
                await openai_client(keyless).completions.create(model=MODEL, prompt="hi", max_tokens=1)
            assert refused.value.status_code == 502 and refused.value.body["code"] == "upstream_auth_failed"


@pytest.mark.parametrize("router_key", [None, "wrong-secret"])
async def test_a_replica_refusing_the_routers_key_is_a_502_that_says_so_not_an_unknown_model(router_key, caplog):
    """The issue's case: with a wrong replica key clients were told the model does not exist (the
    replica's /v1/models answered 401, so no model was known).  Now a 502 naming the fleet's key,
    an error log line and kvroute_replica_auth_refusals_total{replica}."""
    fleet = {"replica_api_key": router_key} if router_key else {}
    async with emulated_replicas(1, api_key="replica-secret") as (rep,):
        async with running_router([rep.url], fleet=fleet) as app:
            with pytest.raises(openai.APIStatusError) as refused:
                await openai_client(app).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert refused.value.status_code == 502
            assert refused.value.body["code"] == "upstream_auth_failed"
            assert "fleet.replica_api_key" in refused.value.body["message"] and rep.url in refused.value.body["message"]
            samples = await scrape(app.url)
            assert samples[("kvroute_replica_auth_refusals_total", (("replica", label(rep.url)),))] >= 1
            errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert any("refuses the router's API key" in m and "fleet.replica_api_key" in m for m in errors), errors


async def test_a_proxied_request_the_replica_refuses_is_a_502_not_the_replicas_401():
    """The replica's key changed after it joined: its 401 to a proxied request is not passed on as
    if the client's key were wrong; the request is a 502 upstream_auth_failed, counted."""
    async with emulated_replicas(1, api_key="replica-secret") as (rep,):
        async with running_router([rep.url], fleet={"replica_api_key": "replica-secret"}) as app:
            client = openai_client(app)
            assert (await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)).choices
            rep.handlers.api_key = "rotated"
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            assert refused.value.status_code == 502 and refused.value.body["code"] == "upstream_auth_failed"
            samples = await scrape(app.url)
            assert samples[("kvroute_upstream_failures_total", (("replica", label(rep.url)), ("stage", "auth")))] == 1
            assert samples[("kvroute_replica_auth_refusals_total", (("replica", label(rep.url)),))] == 1
