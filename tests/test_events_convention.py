"""KV events of replicas nobody registered: found by convention (the host of the replica's URL,
fleet.events_port / replay_port), named in the config file, or found silent and routed on
predictions.  Real emulated replicas publishing over real ZMQ, a real router app, real Redis for
the registered fleet it is compared with.

The convention ports are literal (5557/5558) when both are free on 127.0.0.2 and 127.0.0.3
(Linux routes all of 127/8 to loopback), so the replicas there publish exactly where a vLLM pod
would; otherwise a free pair, given to the router as fleet.events_port / replay_port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvroute.replica.emulated.publisher import KVEventPublisher
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from kvroute.router.app import RouterApp
from kvroute.router.config import load_settings
from kvroute.router.fleet.discovery import EventEndpointResolver, ReplicaEntry
from kvroute.common.registration import KeptRegistration, ReplicaRecord
from tests.conftest import free_port
from tests.router_support import MODEL, TINY_TOKENIZER, label, running_router, scrape, started, total

ADMIN = "admin-token"
HOSTS = ("127.0.0.2", "127.0.0.3")
DEFAULT_PORTS = (5557, 5558)
SILENT_AFTER_S = 1.0


def bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def convention_ports() -> tuple[int, int]:
    """vLLM's 5557/5558 when free on every test host, else a free pair (checked on each)."""
    if all(bindable(h, p) for h in HOSTS for p in DEFAULT_PORTS):
        return DEFAULT_PORTS
    for _ in range(100):
        pair = (free_port(), free_port())
        if pair[0] != pair[1] and all(bindable(h, p) for h in HOSTS for p in pair):
            return pair
    raise AssertionError("no free port pair on 127.0.0.2 and 127.0.0.3")


def port_flags(ports: tuple[int, int]) -> list[str]:
    """Nothing when the ports are the defaults: the router then has only --replicas."""
    if ports == DEFAULT_PORTS:
        return []
    return ["--fleet.events-port", str(ports[0]), "--fleet.replay-port", str(ports[1])]


def replica(host: str = "127.0.0.1", events: str | None = None, replay: str | None = None, **config: Any) -> EmulatedReplica:
    return EmulatedReplica(ReplicaConfig(model=MODEL, host=host, profile="cpu-tiny", time_scale=0.0, num_gpu_blocks=64,
                                         events_endpoint=events, replay_endpoint=replay, **config))



@contextlib.asynccontextmanager
async def cli_router(*flags: str) -> AsyncIterator[RouterApp]:
    """A router from command-line flags, as `kvroute router FLAGS` builds it (loopback, any port)."""
    settings = load_settings(["--host", "127.0.0.1", "--port", "0", "--tokenizer", TINY_TOKENIZER,
                              "--admin-token", ADMIN, *flags])
    app = RouterApp(settings)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def admin_replicas(app: RouterApp) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(
        app.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as resp:
        assert resp.status == 200
        return {r["name"]: r for r in (await resp.json())["replicas"]}


async def until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def states(app: RouterApp) -> dict[str, str]:
    return {name: r["kv_events"] for name, r in (await admin_replicas(app)).items()}


def state_gauge(samples: dict, url: str) -> dict[str, float]:
    """The KV-event state gauge of the replica at ``url`` (labelled by its host:port)."""
    return {dict(lab)["state"]: v for (name, lab), v in samples.items()
            if name == "kvroute_replica_kv_events_state" and dict(lab)["replica"] == label(url)}


async def chat(http: aiohttp.ClientSession, app: RouterApp, content: str) -> int:
    """One answered request; its cached prompt tokens (reuse delivered)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    async with http.post(app.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def workload(seed: int = 7) -> list[str]:
    """Six ~400-token documents asked about four times each, in shuffled order.  Two replicas of
    64 blocks hold about three of them at a time, so they evict, and where the events say a
    document still is decides where its next question goes (predictions alone route this
    workload differently)."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    docs = [" ".join(rng.choice(words) for _ in range(100)) for _ in range(6)]
    order = [(turn, doc) for turn in range(4) for doc in range(len(docs))]
    rng.shuffle(order)
    return [f"{docs[doc]}\nQuestion {turn}: what about {words[turn]}?" for turn, doc in order]


async def run_workload(app: RouterApp, replicas: list[EmulatedReplica]) -> tuple[list[int], list[int]]:
    """Each request's replica (by position in ``replicas``) and cached tokens.  After each answer
    the router has applied every batch the replicas published (routing never races the events)."""
    choices, cached = [], []
    async with aiohttp.ClientSession() as http:
        for content in workload():
            before = [r.engine.prompt_tokens_total for r in replicas]
            cached.append(await chat(http, app, content))
            served = [i for i, r in enumerate(replicas) if r.engine.prompt_tokens_total != before[i]]
            assert len(served) == 1
            choices.append(served[0])
            for r in replicas:
                followed = app.kv_events is not None and app.kv_events.status(r.url) is not None
                if followed and r.publisher is not None and r.publisher.next_seq:
                    await app.kv_events.wait_applied(r.url, r.publisher.next_seq - 1)  # type: ignore[union-attr]
    return choices, cached


def relabelled(choices: list[int]) -> list[int]:
    """Choices with replicas numbered by first use: two fleets' runs compare regardless of which
    of two equally good empty replicas the first request took."""
    first: dict[int, int] = {}
    return [first.setdefault(c, len(first)) for c in choices]


# -- the convention, end to end ---------------------------------------------------------------


async def test_replicas_given_only_by_url_are_followed_and_route_as_a_registered_fleet(redis_url, redis_prefix, capsys):
    events_port, replay_port = ports = convention_ports()
    by_convention = [replica(h, f"tcp://*:{events_port}", f"tcp://*:{replay_port}") for h in HOSTS]
    async with started(*by_convention):
        urls = [r.url for r in by_convention]
        assert [r.events_endpoint for r in by_convention] == [f"tcp://{h}:{events_port}" for h in HOSTS]
        async with cli_router("--replicas", ",".join(urls), *port_flags(ports)) as app:
            await until(lambda: _all(app, "following"), what="both replicas followed")
            status = await admin_replicas(app)
            for r, h in zip(by_convention, HOSTS):
                st = status[r.url]
                assert (st["events_origin"], st["events_endpoint"], st["replay_endpoint"]) == (
                    "convention", f"tcp://{h}:{events_port}", f"tcp://{h}:{replay_port}")
            conv_choices, conv_cached = await run_workload(app, by_convention)
            samples = await scrape(app.url)
            applied = total(samples, "kvroute_kv_events_applied_total", type="BlockStored")
            assert applied > 0
            for url in urls:
                assert state_gauge(samples, url) == {"off": 0.0, "pending": 0.0, "following": 1.0, "silent": 0.0}

    # The same requests against fresh replicas registered in Redis by a launcher (endpoints on
    # free ports, nothing by convention): the same choices and the same reuse delivered.
    registered = [replica("127.0.0.1", f"tcp://*:{free_port()}", f"tcp://*:{free_port()}") for _ in HOSTS]
    async with started(*registered), contextlib.AsyncExitStack() as stack:
        for r in registered:
            record = ReplicaRecord(url=r.url, model=MODEL, events_endpoint=r.events_endpoint,
                                   replay_endpoint=r.replay_endpoint, engine="emulated")
            kept = KeptRegistration(redis_url, redis_prefix, record, ttl=30.0)
            await kept.start()
            stack.push_async_callback(kept.deregister)
        fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
        async with running_router([], admin_token=ADMIN, fleet=fleet) as app:
            await until(lambda: _all(app, "following", count=2), what="both registered replicas followed")
            assert {st["events_origin"] for st in (await admin_replicas(app)).values()} == {"registered"}
            reg_choices, reg_cached = await run_workload(app, registered)
            reg_applied = total(await scrape(app.url), "kvroute_kv_events_applied_total", type="BlockStored")

    with capsys.disabled():
        print(f"\nconvention {ports}: BlockStored applied {applied:.0f}, choices {relabelled(conv_choices)}, "
              f"cached tokens {sum(conv_cached)}\nregistered: BlockStored applied {reg_applied:.0f}, "
              f"choices {relabelled(reg_choices)}, cached tokens {sum(reg_cached)}")
    assert relabelled(conv_choices) == relabelled(reg_choices)
    assert conv_cached == reg_cached and sum(conv_cached) > 0
    assert applied == reg_applied


async def _all(app: RouterApp, state: str, count: int | None = None) -> bool:
    current = await states(app)
    return bool(current) and (count is None or len(current) == count) and set(current.values()) == {state}


async def test_a_replica_without_events_is_found_silent_routed_on_predictions_and_logged_once(caplog):
    # 127.0.0.4 publishes nothing: its conventional endpoints have nobody behind them.
    ports = (free_port(), free_port())
    async with started(replica(HOSTS[0], f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}"), replica("127.0.0.4")) as (
        publishing, quiet
    ):
        caplog.set_level(logging.INFO)
        fleet = {"events_port": ports[0], "replay_port": ports[1], "events_silent_after_s": SILENT_AFTER_S}
        async with running_router([publishing.url, quiet.url], admin_token=ADMIN, fleet=fleet,
                                  predicted_ttl_s=0.5) as app:
            await until(lambda: _states_are(app, {publishing.url: "following", quiet.url: "silent"}),
                        what="one following, one silent")
            st = (await admin_replicas(app))[quiet.url]
            assert (st["events_origin"], st["events_endpoint"], st["healthy"]) == (
                "convention", f"tcp://127.0.0.4:{ports[0]}", True)
            assert state_gauge(await scrape(app.url), quiet.url) == {
                "off": 0.0, "pending": 0.0, "following": 0.0, "silent": 1.0}

            # Routed on predictions: the index keeps the silent replica's (nothing would confirm
            # them) and lets the followed one's expire (its events say what it holds).
            await until(lambda: _index_mode_applied(app), what="the index told about the silent replica")
            await app.index.record_prediction(quiet.url, [101, 102])
            await app.index.record_prediction(publishing.url, [201, 202])
            await asyncio.sleep(0.8)
            assert await app.index.lookup([101, 102]) == {quiet.url: 2}
            assert await app.index.lookup([201, 202]) == {}
            async with aiohttp.ClientSession() as http:
                for i in range(4):  # it still serves
                    await chat(http, app, f"request {i} " * 40)

            await asyncio.sleep(3 * SILENT_AFTER_S)  # no error loop: said once, not again
            said = [r.getMessage() for r in caplog.records if quiet.url in r.getMessage() and r.levelno >= logging.WARNING]
            assert len(said) == 2, said
            assert sum("replay from seq 0" in m for m in said) == 1 and sum("no KV events from" in m for m in said) == 1
            assert (await states(app))[quiet.url] == "silent"


async def _states_are(app: RouterApp, want: dict[str, str]) -> bool:
    return await states(app) == want


async def _index_mode_applied(app: RouterApp) -> bool:
    # the fleet tells the index in a task of its own; its spec is what the next sync compares to
    return all(r.indexed_spec is not None and r.indexed_spec.publishes_events == (r.kv_events == "following")
               for r in app.fleet.replicas())


async def test_a_silent_replica_is_followed_once_it_publishes():
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    async with started(replica()) as (rep,):
        # nobody publishes at the configured endpoints yet (a replica whose events start late)
        entry = {"url": rep.url, "events_endpoint": events, "replay_endpoint": replay}
        async with running_router([entry], admin_token=ADMIN, fleet={"events_silent_after_s": SILENT_AFTER_S}) as app:
            await until(lambda: _states_are(app, {rep.url: "silent"}), what="silent")
            assert (await admin_replicas(app))[rep.url]["events_origin"] == "configured"
            publisher = KVEventPublisher(events.replace("127.0.0.1", "*"), replay.replace("127.0.0.1", "*"),
                                         bind_host="127.0.0.1")
            await publisher.start()
            try:
                await until(lambda: _states_are(app, {rep.url: "following"}), timeout=15.0, what="following")
            finally:
                await publisher.close()


async def test_the_convention_off_and_a_replica_declared_without_events():
    async with started(replica(), replica()) as (a, b):
        # b's entry says it publishes nothing: not followed, whatever the convention says
        async with running_router([a.url, {"url": b.url, "events_endpoint": ""}], admin_token=ADMIN,
                                  fleet={"events_port": 0}) as app:
            status = await admin_replicas(app)
            assert {(st["kv_events"], st["events_endpoint"], st["events_origin"]) for st in status.values()} == {
                ("off", None, None)}
            assert app.kv_events is not None and app.kv_events.watched() == []
            assert state_gauge(await scrape(app.url), a.url)["off"] == 1.0


async def test_a_router_told_not_to_follow_events_routes_every_replica_on_predictions():
    ports = (free_port(), free_port())
    async with started(replica(HOSTS[1], f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}")) as (rep,):
        fleet = {"events_port": ports[0], "replay_port": ports[1]}
        async with running_router([rep.url], admin_token=ADMIN, fleet=fleet, kv_events=False,
                                  predicted_ttl_s=0.3) as app:
            st = (await admin_replicas(app))[rep.url]
            # the endpoint is known (the convention), but nobody follows it: off, predictions kept
            assert (st["kv_events"], st["events_origin"]) == ("off", "convention")
            await app.index.record_prediction(rep.url, [301, 302])
            await asyncio.sleep(0.6)
            assert await app.index.lookup([301, 302]) == {rep.url: 2}


async def test_a_redis_registration_wins_over_the_convention(redis_url, redis_prefix):
    host = "127.0.0.5"
    async with started(replica(host, f"tcp://*:{free_port()}", f"tcp://*:{free_port()}")) as (rep,):
        record = ReplicaRecord(url=rep.url, model=MODEL, events_endpoint=rep.events_endpoint,
                               replay_endpoint=rep.replay_endpoint, engine="emulated")
        kept = KeptRegistration(redis_url, redis_prefix, record, ttl=30.0)
        await kept.start()
        try:
            fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
            async with running_router([rep.url], admin_token=ADMIN, fleet=fleet) as app:  # static too
                await until(lambda: _states_are(app, {rep.url: "following"}), what="following")
                st = (await admin_replicas(app))[rep.url]
                assert st["sources"] == ["redis", "static"]
                assert (st["events_origin"], st["events_endpoint"]) == ("registered", rep.events_endpoint)
        finally:
            await kept.deregister()


async def test_a_replica_found_by_dns_is_followed_by_convention():
    ports = (free_port(), free_port())
    async with started(replica(HOSTS[0], f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}")) as (rep,):
        fleet = {"dns_name": f"{HOSTS[0]}:{rep.port}", "events_port": ports[0], "replay_port": ports[1]}
        async with running_router([], admin_token=ADMIN, fleet=fleet) as app:
            await until(lambda: _states_are(app, {rep.url: "following"}), what="following")
            st = (await admin_replicas(app))[rep.url]
            assert (st["sources"], st["events_origin"]) == (["dns"], "convention")


async def test_a_registration_naming_the_conventional_endpoints_keeps_the_stream(redis_url, redis_prefix):
    ports = (free_port(), free_port())
    async with started(replica("127.0.0.6", f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}")) as (rep,):
        fleet = {"events_port": ports[0], "replay_port": ports[1], "health_interval_s": 0.2,
                 "discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
        async with running_router([rep.url], admin_token=ADMIN, fleet=fleet) as app:
            await until(lambda: _states_are(app, {rep.url: "following"}), what="following by convention")
            seen: list[str] = []
            app.fleet.subscribe(lambda event, r: seen.append(event))
            record = ReplicaRecord(url=rep.url, model=MODEL, events_endpoint=rep.events_endpoint,
                                   replay_endpoint=rep.replay_endpoint, engine="emulated")
            kept = KeptRegistration(redis_url, redis_prefix, record, ttl=30.0)
            await kept.start()
            try:
                await until(lambda: _origin_is(app, rep.url, "registered"), what="the registration seen")
                assert (await states(app))[rep.url] == "following"  # not back to pending for good
                assert "changed" not in seen  # the same endpoints: the stream goes on
            finally:
                await kept.deregister()


async def _origin_is(app: RouterApp, name: str, origin: str) -> bool:
    return (await admin_replicas(app))[name]["events_origin"] == origin


# -- settings and the resolution rule ---------------------------------------------------------


def test_replicas_as_objects_in_the_config_file_beside_plain_urls(tmp_path, monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)
    cfg = tmp_path / "router.toml"
    cfg.write_text('replicas = ["http://10.0.0.1:8000", {url = "http://10.0.0.2:8000", '
                   'events_endpoint = "tcp://10.0.0.2:6000", replay_endpoint = ""}]\n'
                   '[fleet]\nevents_topic = "kv"\nevents_silent_after_s = 3\n')
    s = load_settings(["--config", str(cfg), "--replicas", "http://10.0.0.3:8000"])  # the flag beats the file
    assert s.fleet.replicas == ["http://10.0.0.3:8000"]
    s = load_settings(["--config", str(cfg)])
    assert s.fleet.replicas == ["http://10.0.0.1:8000", ReplicaEntry(
        url="http://10.0.0.2:8000", events_endpoint="tcp://10.0.0.2:6000", replay_endpoint="")]
    assert (s.fleet.events_topic, s.fleet.events_silent_after_s, s.fleet.events_port) == ("kv", 3.0, 5557)
    cfg.write_text('replicas = [{url = "http://10.0.0.2:8000", events_endpoint = "http://nope"}]\n')
    with pytest.raises(ValueError, match="ZMQ address"):
        load_settings(["--config", str(cfg)])


def test_the_resolution_rule():
    entries: list[Any] = [
        "http://a:8000",
        ReplicaEntry(url="http://b:8000", events_endpoint="tcp://b:7000"),  # replay: by convention
        ReplicaEntry(url="http://c:8000", events_endpoint=""),  # publishes none
        "http://[fd00::7]:8000",
        "http://shared:8000", "http://shared:8001",  # one host, two replicas: ambiguous
    ]
    urls = ["http://a:8000", "http://b:8000", "http://c:8000", "http://[fd00::7]:8000", "http://shared:8000",
            "http://shared:8001", "http://registered:8000", "http://bare:8000"]
    records = {
        "http://registered:8000": ReplicaRecord(url="http://registered:8000", events_endpoint="tcp://registered:9",
                                                replay_endpoint="tcp://registered:10"),
        "http://bare:8000": ReplicaRecord(url="http://bare:8000"),  # registered without events: none
    }
    got = EventEndpointResolver(entries, events_port=5557, replay_port=5558).resolve(urls, records)
    assert {u: (e.events, e.replay, e.origin) for u, e in got.items()} == {
        "http://a:8000": ("tcp://a:5557", "tcp://a:5558", "convention"),
        "http://b:8000": ("tcp://b:7000", "tcp://b:5558", "configured"),
        "http://c:8000": (None, None, None),
        "http://[fd00::7]:8000": ("tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558", "convention"),
        "http://shared:8000": (None, None, None),
        "http://shared:8001": (None, None, None),
        "http://registered:8000": ("tcp://registered:9", "tcp://registered:10", "registered"),
        "http://bare:8000": (None, None, None),
    }
    no_replay = EventEndpointResolver([], events_port=5557, replay_port=0).resolve(["http://a:1"], {})
    assert (no_replay["http://a:1"].events, no_replay["http://a:1"].replay) == ("tcp://a:5557", None)
    off = EventEndpointResolver(["http://a:1"], events_port=0, replay_port=5558).resolve(["http://a:1"], {})
    assert off["http://a:1"].events is None

