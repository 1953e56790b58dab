"""Signed Redis registrations (docs/design.md §7.7): the two attacks of issue 21 against a real
router, a real Redis, a replica started by `kvroute replica` with the secret, and a rogue HTTP
server recording what it receives.

With a secret the router believes only registrations signed with it: a new unsigned entry and an
overwritten legitimate one are ignored, counted and logged once; the rogue gets no request and
never the replica API key, while the signed replica serves.  Without one, the rogue joins and
gets the key (what the secret prevents), and the router warns at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from kvroute.common.registration import names_key, record_key
from kvroute.common.registration_auth import CLOCK_SKEW_S, read_secrets, sign, verify
from tests.conftest import free_port
from tests.router_support import MODEL, TINY_TOKENIZER, ScriptedReplica, running_router, scrape, total

ROOT = Path(__file__).resolve().parents[1]
SECRET = "registration-secret-of-this-test"
REPLICA_KEY = "replica-key-of-this-test"
CHATS = 12


# -- the signature itself ------------------------------------------------------------------------


def test_a_signed_entry_verifies_and_every_alteration_does_not():
    fields = {"url": "http://10.0.0.5:8000", "name": "a", "model": "m", "engine": "vllm"}
    signed = sign(fields, "pfx", "a", b"s", expires_at=time.time() + 15)
    assert verify(signed, "pfx", "a", b"s", time.time()) is None
    assert verify(fields, "pfx", "a", b"s", time.time()) == "unsigned"
    assert verify({**signed, "url": "http://rogue:1"}, "pfx", "a", b"s", time.time()) == "bad_signature"
    assert verify({**signed, "extra": "x"}, "pfx", "a", b"s", time.time()) == "bad_signature"  # no field added
    assert verify(signed, "pfx", "b", b"s", time.time()) == "bad_signature"  # copied to another name
    assert verify(signed, "other", "a", b"s", time.time()) == "bad_signature"  # or another fleet's prefix
    assert verify(signed, "pfx", "a", b"other secret", time.time()) == "bad_signature"
    # a replayed copy expires: believed until its expiry (and the clock skew allowed), then not
    assert verify(signed, "pfx", "a", b"s", time.time() + 15 + CLOCK_SKEW_S - 1) is None
    assert verify(signed, "pfx", "a", b"s", time.time() + 15 + CLOCK_SKEW_S + 1) == "stale"


def test_the_secret_file_is_read_without_its_newline_and_a_bad_one_is_an_error(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    assert read_secrets(None, path) == (b"s3cret",) and read_secrets("inline", None) == (b"inline",)
    assert read_secrets(None, None) == ()
    path.write_text("\n")
    for value, file in ((None, path), ("inline", path), (None, tmp_path / "missing")):
        with pytest.raises(ValueError):
            read_secrets(value, file)


def test_a_file_of_several_secrets_lists_them_in_order_and_any_verifies(tmp_path):
    """One secret per line (a rotation: the one launchers sign with first, then the previous), blank
    lines and surrounding space ignored; an entry signed with any of them verifies, with none not."""
    path = tmp_path / "secret"
    path.write_text("new-secret\n\n  old-secret \n")
    assert read_secrets(None, path) == (b"new-secret", b"old-secret")
    fields = {"url": "http://10.0.0.5:8000", "name": "a", "model": "m"}
    for key in (b"new-secret", b"old-secret"):
        signed = sign(fields, "pfx", "a", key, expires_at=time.time() + 15)
        assert verify(signed, "pfx", "a", read_secrets(None, path), time.time()) is None
    signed = sign(fields, "pfx", "a", b"a third secret", expires_at=time.time() + 15)
    assert verify(signed, "pfx", "a", read_secrets(None, path), time.time()) == "bad_signature"


# -- the attacks against a real router -----------------------------------------------------------


class Rogue(ScriptedReplica):
    """Answers like a replica serving MODEL; records every request and its Authorization header."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str | None]] = []

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.path, request.headers.get("Authorization")))
            return await handler(request)

        self.runner.app.middlewares.append(record)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({
            "id": "chatcmpl-rogue", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "fabricated"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip


def start_replica(redis_url: str, prefix: str, secret_file: Path, ttl: float) -> tuple[subprocess.Popen[str], str]:
    """`kvroute replica --engine emulated` registering itself, signed, as users run it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "replica", "--engine", "emulated", "--model", MODEL,
         "--host", "127.0.0.1", "--port", str(port), "--time-scale", "0", "--tokenizer", TINY_TOKENIZER,
         "--api-key", REPLICA_KEY, "--redis-url", redis_url, "--redis-key-prefix", prefix,
         "--registration-ttl", str(ttl), "--registration-secret-file", str(secret_file), "--drain-grace", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")},
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def until(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def chats(app: Any) -> list[str]:
    client = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    try:
        out = []
        for i in range(CHATS):
            resp = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"conversation {i}: hello"}], max_tokens=4
            )
            out.append(resp.choices[0].message.content or "")
        return out
    finally:
        await client.close()


def router_overrides(redis_url: str, prefix: str, **more: Any) -> dict[str, Any]:
    fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": prefix, "replica_api_key": REPLICA_KEY,
             "health_interval_s": 0.2, "events_port": 0, "replay_port": 0}
    return {"fleet": fleet, "kv_events": False, **more}


async def test_with_a_secret_neither_a_new_nor_an_overwritten_registration_steers_traffic(
    redis_url, redis_prefix, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="kvroute.router.fleet")
    secret_file = tmp_path / "registration-secret"
    secret_file.write_text(SECRET + "\n")  # as a mounted Secret may hold it
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    proc, legit = start_replica(redis_url, redis_prefix, secret_file, ttl=9.0)  # re-signed every 3 s
    try:
        async with Rogue() as rogue, running_router(
            [], **router_overrides(redis_url, redis_prefix, registration_secret_file=secret_file)
        ) as app:
            await until(lambda: _healthy(app, legit), "the signed replica to join")
            assert len(await chats(app)) == CHATS

            # attack 1: a new entry, as the issue wrote it
            await redis.hset(record_key(redis_prefix, "evil"), mapping={"url": rogue.url, "model": MODEL})
            await redis.sadd(names_key(redis_prefix), "evil")
            await until(lambda: _rejected(app, "unsigned", 10), "the unsigned entry rejected at 10 listings")
            assert app.fleet.get(rogue.url) is None
            assert "fabricated" not in await chats(app) and rogue.seen == []

            # attack 2: the legitimate replica's entry pointed at the rogue: ignored, so the replica
            # leaves the fleet, until its next heartbeat rewrites the entry, signed
            await redis.hset(record_key(redis_prefix, legit), "url", rogue.url)
            await until(lambda: _rejected(app, "bad_signature", 1), "the overwritten entry rejected")
            await until(lambda: _gone(app, legit), "the replica whose entry no longer verifies to leave")
            await until(lambda: _healthy(app, legit), "its heartbeat to restore it", timeout=20)
            answers = await chats(app)
            assert "fabricated" not in answers and len(answers) == CHATS

            assert rogue.seen == []  # not one request, not even a health check: the key never went there
            samples = await scrape(app.url)
            # (its series restart when it rejoins: the requests since)
            # series are labelled by the replica's name; kvroute_replica_info maps its URL to it
            label = {dict(labels)["url"]: dict(labels)["replica"] for (name, labels) in samples
                     if name == "kvroute_replica_info"}
            assert total(samples, "kvroute_requests_total", replica=label[legit], status="200") >= CHATS
            assert rogue.url not in label
            for rogue_label in (rogue.url, rogue.url.split("//", 1)[1], "evil"):
                assert total(samples, "kvroute_requests_total", replica=rogue_label) == 0
            warned = [r.getMessage() for r in caplog.records if "ignoring the Redis registration" in r.getMessage()]
            assert len([m for m in warned if "'evil'" in m and "unsigned" in m]) == 1, warned  # once, not per poll
            assert any(repr(legit) in m and "signature does not match" in m for m in warned), warned
            assert not any("without a registration secret" in r.getMessage() for r in caplog.records)
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
        await redis.aclose()


async def test_a_rotation_keeps_every_replica_believed_by_routers_holding_both_secrets(redis_url, redis_prefix, tmp_path):
    """Rotation without a gap (docs/deploy.md): a router whose secret file holds the new and the old
    secret still believes a replica whose launcher signs with the old one, while a router with
    only the new one ignores it (bad_signature); a launcher given both signs with the first line,
    the new one, which both routers believe and the old secret alone does not verify."""
    from kvroute.common.registration import list_registrations

    old, new = "the-old-registration-secret", "the-new-registration-secret"
    files = {}
    for name, text in (("old", f"{old}\n"), ("both", f"{old}\n{new}\n"), ("new", f"{new}\n"),
                       ("launcher", f"{new}\n{old}\n")):  # the launcher's: the new first, as in step 2
        files[name] = tmp_path / name
        files[name].write_text(text)
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    not_rolled, old_url = start_replica(redis_url, redis_prefix, files["old"], ttl=9.0)
    rolled, new_url = start_replica(redis_url, redis_prefix, files["launcher"], ttl=9.0)
    try:
        async with running_router([], **router_overrides(redis_url, redis_prefix, registration_secret_file=files["both"])) \
                as both, running_router([], **router_overrides(redis_url, redis_prefix,
                                                               registration_secret_file=files["new"])) as only_new:
            await until(lambda: _healthy(both, old_url), "the replica signing with the old secret to join")
            await until(lambda: _healthy(both, new_url), "the replica signing with the new secret to join")
            await until(lambda: _healthy(only_new, new_url), "the new-secret router to take the rolled replica")
            await until(lambda: _rejected(only_new, "bad_signature", 3), "the new-secret router to refuse the old one")
            assert only_new.fleet.get(old_url) is None
            assert total(await scrape(both.url), "kvroute_discovery_rejected_total") == 0
            assert len(await chats(both)) == len(await chats(only_new)) == CHATS
        listed = dict(await list_registrations(redis, redis_prefix))
        assert verify(listed[new_url], redis_prefix, new_url, new.encode(), time.time()) is None
        assert verify(listed[new_url], redis_prefix, new_url, old.encode(), time.time()) == "bad_signature"
        assert verify(listed[old_url], redis_prefix, old_url, new.encode(), time.time()) == "bad_signature"
    finally:
        for proc in (not_rolled, rolled):
            proc.terminate()
            proc.communicate(timeout=20)
        await redis.aclose()


async def test_without_a_secret_the_router_warns_and_a_rogue_entry_gets_the_key(redis_url, redis_prefix, caplog):
    """The behaviour kept for fleets without a secret, and what the secret prevents."""
    caplog.set_level(logging.WARNING, logger="kvroute.router.fleet")
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        async with Rogue() as rogue, running_router([], **router_overrides(redis_url, redis_prefix)) as app:
            assert any("without a registration secret" in r.getMessage() for r in caplog.records)
            await redis.hset(record_key(redis_prefix, "evil"), mapping={"url": rogue.url, "model": MODEL})
            await redis.sadd(names_key(redis_prefix), "evil")
            await until(lambda: _healthy(app, rogue.url), "the rogue to join")
            assert set(await chats(app)) == {"fabricated"}
            assert ("/v1/chat/completions", f"Bearer {REPLICA_KEY}") in rogue.seen
            assert total(await scrape(app.url), "kvroute_discovery_rejected_total") == 0
    finally:
        await redis.aclose()


async def test_a_replayed_registration_expires(redis_url, redis_prefix):
    """A signed entry captured and written back after its expiry is `stale`, not believed."""
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        async with Rogue() as rogue, running_router(
            [], **router_overrides(redis_url, redis_prefix, registration_secret=SECRET)
        ) as app:
            old = sign({"url": rogue.url, "name": "old", "model": MODEL}, redis_prefix, "old", SECRET.encode(),
                       expires_at=time.time() - CLOCK_SKEW_S - 1)
            await redis.hset(record_key(redis_prefix, "old"), mapping=old)
            await redis.sadd(names_key(redis_prefix), "old")
            await until(lambda: _rejected(app, "stale", 3), "the expired entry rejected")
            assert app.fleet.get(rogue.url) is None and rogue.seen == []
    finally:
        await redis.aclose()


# vLLM's command line served by the emulated replica: what the vLLM launcher runs, without vLLM
# (HTTPS too: vLLM's --ssl-* flags are the emulated replica's)
STAND_IN_VLLM = """
import argparse, asyncio
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig

p = argparse.ArgumentParser()
for flag in ("--served-model-name", "--host", "--port", "--block-size", "--ssl-certfile", "--ssl-keyfile",
             "--ssl-ca-certs", "--ssl-cert-reqs"):
    p.add_argument(flag)
args, _ = p.parse_known_args()

async def main():
    config = ReplicaConfig(model=args.served_model_name, host=args.host, port=int(args.port),
                           block_size=int(args.block_size), time_scale=0, ssl_certfile=args.ssl_certfile,
                           ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                           ssl_cert_reqs=int(args.ssl_cert_reqs or 0))
    await EmulatedReplica(config).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_vllm_launcher(tmp_path: Path, port: int, redis_url: str, prefix: str, *more: str) -> subprocess.Popen[str]:
    """`kvroute replica --engine vllm` as users run it, registering in Redis, with ``more`` of its
    arguments, in front of STAND_IN_VLLM (written to ``tmp_path``) instead of vLLM."""
    (tmp_path / "stand_in_vllm.py").write_text(STAND_IN_VLLM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), env.get("PYTHONPATH"))))
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "replica", "--engine", "vllm", "--model", MODEL, "--model-path",
         str(tmp_path), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--vllm-python",
         sys.executable, "--vllm-entry", "stand_in_vllm", "--redis-url", redis_url, "--redis-key-prefix", prefix,
         "--startup-timeout", "60", "--drain-timeout", "1", "--drain-grace", "0", *more],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


async def test_the_vllm_launcher_signs_its_registration(redis_url, redis_prefix, tmp_path):
    """`kvroute replica --engine vllm` (a stand-in vLLM) registers signed: a router with the
    secret believes it, and its hash verifies with the secret and with nothing else."""
    from kvroute.common.registration import list_registrations

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    port = free_port()
    proc = start_vllm_launcher(tmp_path, port, redis_url, redis_prefix, "--registration-secret-file", str(secret_file))
    redis = aioredis.Redis.from_url(redis_url)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)  # the ready line
        url = f"http://127.0.0.1:{port}"
        assert line.startswith(url), (line, proc.poll() is not None and proc.stderr.read())
        ((name, fields),) = await list_registrations(redis, redis_prefix)
        assert (name, fields["url"], fields["engine"]) == (url, url, "vllm")
        assert verify(fields, redis_prefix, name, SECRET.encode(), time.time()) is None
        assert verify(fields, redis_prefix, name, b"another secret", time.time()) == "bad_signature"
        async with running_router(
            [], **router_overrides(redis_url, redis_prefix, registration_secret_file=secret_file)
        ) as app:
            await until(lambda: _healthy(app, url), "the signed vLLM replica to join")
            assert len(await chats(app)) == CHATS
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        await redis.aclose()


async def _healthy(app: Any, url: str) -> bool:
    r = app.fleet.get(url)
    return r is not None and r.healthy


async def _gone(app: Any, url: str) -> bool:
    return app.fleet.get(url) is None


async def _rejected(app: Any, reason: str, at_least: float) -> bool:
    return total(await scrape(app.url), "kvroute_discovery_rejected_total", reason=reason) >= at_least
