"""JSON logs and the access log of a real `kvroute router` process, read from its stderr."""

from __future__ import annotations

import asyncio
import json
import sys

import openai
import pytest
from aiohttp import web

from tests.router_support import MODEL, REPO, TINY_TOKENIZER, ScriptedReplica, emulated_replicas

SYSTEM = "You are a meticulous assistant for the kvroute access log test. " * 12


async def _start_router(replica_urls: list[str], *args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "router", "--host", "127.0.0.1", "--port", "0",
        "--replicas", ",".join(replica_urls), "--tokenizer", TINY_TOKENIZER, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO),
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    url = line.rsplit(" ", 1)[-1].strip()
    if not url.startswith("http://"):
        proc.kill()
        raise AssertionError(f"router did not start: {line!r} {(await proc.stderr.read()).decode()[-2000:]}")
    return proc, url


async def _stop(proc: asyncio.subprocess.Process) -> str:
    """SIGTERM, then everything it wrote to stderr."""
    proc.terminate()
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return err.decode()


async def _wait_ready(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("router never ready")


async def test_json_log_lines_and_access_log_with_cached_tokens_on_a_second_turn():
    async with emulated_replicas(2) as reps:
        proc, url = await _start_router([r.url for r in reps], "--log-format", "json", "--log-level", "info")
        try:
            await _wait_ready(url)
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
            first = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=5, extra_headers={"X-Request-Id": "turn-1"}
            )
            msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Second question?"}]
            # streamed, and the client does not ask for usage: the router does, and logs it
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=7, stream=True, extra_headers={"X-Request-Id": "turn-2"}
            )
            chunks = [c async for c in stream]
            assert chunks and all(c.usage is None for c in chunks)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=msgs, extra_headers={"X-Request-Id": "bad"})
            await client.close()
        finally:
            stderr = await _stop(proc)

    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # every line is JSON
    assert all({"ts", "level", "logger", "msg"} <= set(rec) for rec in lines)
    assert any(rec["logger"] == "kvroute.router" and "listening" in rec["msg"] for rec in lines)
    access = {rec["request_id"]: rec for rec in lines if rec["logger"] == "kvroute.access"}
    assert set(access) == {"turn-1", "turn-2", "bad"}  # probes (/ready) are not logged

    one, two, bad = access["turn-1"], access["turn-2"], access["bad"]
    for rec in (one, two):
        assert rec["method"] == "POST" and rec["path"] == "/v1/chat/completions" and rec["status"] == 200
        assert rec["model"] == MODEL and rec["replica"] in {r.url for r in reps}
        assert rec["client"] == "127.0.0.1" and rec["reason"] and rec["attempts"] == 1
        assert rec["duration_ms"] > 0 and rec["prompt_tokens"] > 0
    # nothing cached: vLLM leaves prompt_tokens_details null, which says nothing until a replica has
    # reported details once (as the reuse metrics read it)
    assert one["cached_tokens"] is None and one["completion_tokens"] == 5 and one["ttft_ms"] is None
    # the second turn went where the first is cached, and the replica said so in its usage chunk
    assert two["replica"] == one["replica"]
    assert two["prompt_tokens"] > one["prompt_tokens"]
    assert 0 < two["cached_tokens"] <= one["prompt_tokens"] and two["completion_tokens"] == 7
    assert 0 < two["ttft_ms"] <= two["duration_ms"]
    assert bad["status"] == 404 and bad["model"] == "nope" and bad["replica"] is None


async def test_text_format_and_no_access_log():
    async with emulated_replicas(1) as reps:
        proc, url = await _start_router([reps[0].url], "--log-level", "info")
        try:
            await _wait_ready(url)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                await client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                                extra_headers={"X-Request-Id": "text-1"})
        finally:
            stderr = await _stop(proc)
        line = next(ln for ln in stderr.splitlines() if "kvroute.access" in ln)
        assert "POST /v1/completions 200" in line and "request_id=text-1" in line and "completion_tokens=2" in line

        proc, url = await _start_router([reps[0].url], "--log-level", "info", "--no-access-log")
        try:
            await _wait_ready(url)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                await client.completions.create(model=MODEL, prompt="Once", max_tokens=2)
        finally:
            stderr = await _stop(proc)
        assert "listening" in stderr and "kvroute.access" not in stderr


class BusyReplica(ScriptedReplica):
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text="overloaded")


async def test_the_logged_replica_is_the_one_that_answered_after_failover():
    async with emulated_replicas(1) as (good,), BusyReplica() as busy:
        proc, url = await _start_router([busy.url, good.url], "--log-format", "json", "--policy", "round_robin")
        try:
            await _wait_ready(url)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                for i in range(2):  # round robin: one of the two goes to the busy replica first
                    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2, extra_headers={"X-Request-Id": f"fo-{i}"})
        finally:
            stderr = await _stop(proc)
    access = [json.loads(ln) for ln in stderr.splitlines() if '"kvroute.access"' in ln]
    assert [rec["replica"] for rec in access] == [good.url, good.url]
    assert all((rec["attempts"] == 2) == (rec["reason"] == "failover") for rec in access)
    assert any(rec["reason"] == "failover" for rec in access) and all(rec["status"] == 200 for rec in access)


# -- forged lines (issue 21, 3b): a client's CR, LF and terminal escapes stay inside one line -----

FORGED = "\r\n2026-12-04 00:00:00,000 INFO kvroute.access: GET /v1/models 200 request_id=forged status=200\x1b[2J\x1b[31m"
KEY = "a-client-key"


async def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str]]:
    """``head`` (a request line and headers, as bytes) and ``body`` sent as they are; the answer's
    status and headers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"Connection: close\r\n\r\n" + body)
        answer = (await asyncio.wait_for(reader.read(), 30)).decode("latin-1")
    finally:
        writer.close()
    lines = answer.split("\r\n\r\n", 1)[0].split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}


async def test_client_values_cannot_forge_or_split_a_text_log_line():
    """With the default text format and --api-keys, CR/LF/ESC through the model, the path (no key
    needed for it), the user, the session and the request id: each request gives one access line,
    every line parses, and the parsed fields are what was sent."""
    from urllib.parse import unquote

    from kvroute.common.logs import parse_text_line

    sent: dict[str, dict[str, str]] = {}  # request id -> the fields its access line must hold
    async with emulated_replicas(1) as reps:
        proc, url = await _start_router([reps[0].url], "--log-level", "info", "--api-keys", KEY)
        try:
            await _wait_ready(url)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
                model = MODEL + FORGED
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                         extra_headers={"X-Request-Id": "inj-model"})
                sent["inj-model"] = {"model": model, "path": "/v1/chat/completions", "status": "404"}
                ok = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi" + FORGED}], max_tokens=2,
                    user="user" + FORGED, extra_headers={"X-Request-Id": "inj-user"},
                )
                assert ok.http_response.status_code == 200
                sent["inj-user"] = {"model": MODEL, "status": "200"}
            # the path, without the key (an unknown path is answered 404 before any key is asked
            # for): percent-encoded CR, LF, ESC and spaces
            raw_path = "/v1/x" + "".join(f"%{b:02X}" if b < 0x21 or b > 0x7e else chr(b) for b in FORGED.encode())
            status, headers = await _raw(url, f"GET {raw_path} HTTP/1.1\r\nHost: x\r\nX-Request-Id: inj-path\r\n".encode())
            assert status == 404
            sent["inj-path"] = {"method": "GET", "path": unquote(raw_path), "status": "404"}
            # a request id or a session the router cannot take as sent: UTF-8 bidi override, NEL
            status, headers = await _raw(url, (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 2\r\n").encode()
                + "X-Request-Id: rid\u202e\u0085\r\nX-Session-ID: s\u202e\u2028x\r\n".encode(), b"{}")
            assert status == 400, headers
            sent[headers["x-request-id"]] = {"path": "/v1/chat/completions", "status": "400"}
            # ESC in a header is refused by the HTTP parser before any handler: no access line
            status, _ = await _raw(url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Session-ID: s\x1b[31m\r\n")
            assert status == 400
        finally:
            stderr = await _stop(proc)

    assert not any(c in stderr for c in "\r\x1b\u202e\u2028\x85")
    parsed = [parse_text_line(line) for line in stderr.splitlines()]  # every line is one record
    access = [p for p in parsed if p.logger == "kvroute.access"]
    assert sorted(p.fields["request_id"] for p in access) == sorted(sent), [p.fields for p in access]
    for p in access:
        want = sent[p.fields["request_id"]]
        assert {k: p.fields.get(k) for k in want} == want, p
    # the forged text is inside its request's fields and nowhere else
    assert [p.fields["request_id"] for p in parsed if "forged" in p.msg + str(p.fields)] == ["inj-model", "inj-path"]
