"""A hostile internet in front of a real ``kvroute router`` process (its own event loop, its RSS
read from /proc), with emulated replicas behind it.

- Fuzz: 10,000 generated request bodies (mutated chat and completion requests: wrong types,
  missing and unknown fields, broken JSON, deep nesting, odd encodings, compressed garbage) plus a
  few hundred malformed HTTP heads over raw sockets.  Not one 5xx, every error in OpenAI's shape,
  the RSS after within 1.5x of the RSS before.
- Slow clients: a few hundred slowloris connections (a head trickled a line at a time) and as many
  slow bodies, with ``--max-in-flight 20``; valid requests are all served meanwhile, and every slow
  connection is answered 408 and closed at its timeout.  ``KVROUTE_SLOW_CLIENTS=1024`` runs the
  issue's figure.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import time
from typing import Any

import aiohttp

from kvroute.bench.hostile_inputs import health_while
from tests.router_support import MODEL, RouterProcess, emulated_replicas

FUZZ_BODIES = 10_000
SEED = int(os.environ.get("KVROUTE_FUZZ_SEED", "20261203"))  # another seed explores further
PATHS = ["/v1/chat/completions"] * 5 + ["/v1/completions"] * 3 + ["/v1/embeddings", "/tokenize", "/detokenize"]


# -- the corpus ---------------------------------------------------------------------------------
def _weird_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(14)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([-1, 0, 1, 2**31, 2**32, 2**63, -(2**63), 10**30])
    if pick == 3:
        return rng.choice([0.5, -1.5, 1e308, -0.0, 1e-300])
    if pick == 4:
        return rng.choice(["", "x", "tiny", "\u0000", "\ud800", "\u00e9" * 50, "[{" * 40, "a" * rng.randrange(5000)])
    if pick == 5 and depth < 3:
        return [_weird_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 6 and depth < 3:
        return {rng.choice(["role", "content", "type", "text", "x"]): _weird_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if pick == 7:
        return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(6))]
    if pick == 8:
        return [{"role": rng.choice(["user", "system", "", 3]), "content": _weird_value(rng, 3)}]
    return rng.choice(["tiny", 7, [], {}, "hello"])


_NEST = "\u2063nest"  # a placeholder json.dumps keeps, replaced by the deep value (too deep for json.dumps)


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([50, 127, 129, 500, 3000, 50_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"k":', b"}")])
    return opener * depth + b"1" + closer * depth


def _valid(rng: random.Random, path: str) -> dict[str, Any]:
    if path.endswith("/completions") and "chat" not in path:
        return {"model": MODEL, "prompt": rng.choice(["Say hi", [1, 2, 3], ["a", "b"]]), "max_tokens": 2}
    if path == "/detokenize":
        return {"model": MODEL, "tokens": [1, 2, 3]}
    if path in ("/tokenize", "/v1/embeddings"):
        return {"model": MODEL, "prompt": "hello", "input": "hello"}
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
            "stream": rng.random() < 0.1}


FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
          "temperature", "top_p", "user", "cache_salt", "tokens", "input", "chat_template_kwargs", "x"]


def fuzz_case(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """(path, body bytes, extra headers): mostly invalid, some valid."""
    path = rng.choice(PATHS)
    body = _valid(rng, path)
    headers = {"Content-Type": rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded"])}
    kind = rng.randrange(10)
    if kind <= 3:  # field-level: wrong types, missing, unknown, deep
        for _ in range(rng.randrange(2, 5)):
            field = rng.choice(FIELDS)
            roll = rng.random()
            if roll < 0.2:
                body.pop(field, None)
            elif roll < 0.3:
                body[field] = _NEST
            else:
                body[field] = _weird_value(rng)
        if body.get("max_tokens") not in (None,) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 8) if body["max_tokens"] > 0 else body["max_tokens"]
        if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 8:
            body["max_completion_tokens"] = 8
        raw = json.dumps(body).encode()
        if _NEST in body.values():
            raw = raw.replace(json.dumps(_NEST).encode(), _nested(rng), 1)
    else:
        raw = json.dumps(body).encode()
        if kind <= 6:  # byte-level mutations of the JSON
            data = bytearray(raw)
            for _ in range(rng.randrange(1, 6)):
                op = rng.randrange(4)
                i = rng.randrange(len(data) + 1)
                if op == 0 and data:
                    data[min(i, len(data) - 1)] = rng.randrange(256)
                elif op == 1:
                    del data[i:]
                elif op == 2:
                    data[i:i] = rng.choice([b"\xff\xfe", b"\x00", b"{", b"]", b'"', b"\\u", b"\xed\xa0\x80", b"1e999"])
                else:
                    data[i:i] = data[: rng.randrange(len(data) + 1)]
            raw = bytes(data)
        elif kind == 7:  # the wrong top-level shape
            raw = rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"\xef\xbb\xbf" + raw, raw + b" trailing", raw * 2])
        elif kind == 8:  # compressed: valid, garbage or truncated
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate"])
            zipped = gzip.compress(raw) if headers["Content-Encoding"] == "gzip" else raw
            raw = rng.choice([zipped, zipped[: rng.randrange(1, len(zipped))], os.urandom(rng.randrange(1, 64))])
        else:  # the headers lie
            headers[rng.choice(["X-Request-Id", "X-Session-ID", "Authorization", "Accept-Encoding"])] = rng.choice(
                ["\u00e9t\u00e9", "a" * 500, "Bearer", "", "../../etc", "tab\tinside"]
            )
    return path, raw, headers


BAD_HEADS = [
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n{",
    b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked, identity\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 20_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBad Header: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n: empty-name\r\n\r\n",
    b"GET /health HTTP/1.1\r\nX: a\rb\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)),
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /health HTTP/1.1\r\nContent-Encoding: br\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Encoding: zstd\r\nContent-Length: 4\r\n\r\nabcd",
]


def mutated_head(rng: random.Random) -> bytes:
    head = bytearray(rng.choice(BAD_HEADS))
    if rng.random() < 0.7:
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(head) + 1)
            head[i:i] = rng.choice([b"\x00", b"\r\n", b" ", b"\xff", b":", b"\r\nTransfer-Encoding: chunked"])
    return bytes(head)


# -- checks -------------------------------------------------------------------------------------
def assert_openai_error(status: int, content_type: str, data: bytes, what: Any) -> None:
    assert content_type.startswith("application/json"), (status, content_type, data[:200], what)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), (data[:300], what)


async def _fuzz_bodies(url: str, rng: random.Random, n: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    cases = [fuzz_case(rng) for _ in range(n)]
    queue = iter(cases)
    connector = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     skip_auto_headers=("Content-Type",)) as session:
        async def worker() -> None:
            for path, raw, headers in queue:
                async with session.post(url + path, data=raw, headers=headers) as resp:
                    data = await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert resp.status < 500, (resp.status, data[:300], path, raw[:300], headers)
                    if resp.status >= 400:
                        assert_openai_error(resp.status, resp.headers.get("Content-Type", ""), data, (path, raw[:200]))

        await asyncio.gather(*(worker() for _ in range(16)))
    return statuses


async def _fuzz_heads(port: int, rng: random.Random, n: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = mutated_head(rng)
        writer.write(raw)
        try:
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        if not answer:  # a head still incomplete when the router's header timeout closed it
            statuses[0] = statuses.get(0, 0) + 1
            continue
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        statuses[status] = statuses.get(status, 0) + 1
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        assert status < 500, (answer[:300], raw[:200])
        if status >= 400:
            assert_openai_error(status, headers.get("content-type", ""), body, raw[:200])
    return statuses


async def _warm_up(url: str, n: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            async with session.post(url + "/v1/chat/completions", json={**body, "stream": bool(i % 2)}) as resp:
                assert resp.status == 200
                await resp.read()


async def test_fuzzed_requests_never_5xx_always_openai_errors_and_memory_stays():
    rng = random.Random(SEED)
    async with emulated_replicas(2, max_model_len=256) as reps:
        router = await RouterProcess.start([r.url for r in reps], "--header-timeout-s", "1", "--max-body-bytes", "1048576")
        try:
            await _warm_up(router.url, 100)
            rss_before = router.rss_bytes()
            started = time.monotonic()
            statuses = await _fuzz_bodies(router.url, rng, FUZZ_BODIES)
            head_statuses = await _fuzz_heads(router.port, rng, 300)
            took = time.monotonic() - started
            rss_after = router.rss_bytes()
            print(f"\nfuzz: {FUZZ_BODIES} bodies {dict(sorted(statuses.items()))}, 300 heads "
                  f"{dict(sorted(head_statuses.items()))} in {took:.1f} s; RSS {rss_before / 2**20:.0f} -> "
                  f"{rss_after / 2**20:.0f} MiB")
            assert sum(statuses.values()) == FUZZ_BODIES
            assert sum(v for s, v in statuses.items() if s >= 400) > FUZZ_BODIES // 2  # mostly invalid
            assert statuses.get(200, 0) > 100  # and some valid ones served
            assert rss_after <= 1.5 * rss_before
        finally:
            await router.stop()


# -- slow clients -------------------------------------------------------------------------------
SLOW_CLIENTS = int(os.environ.get("KVROUTE_SLOW_CLIENTS", "200"))
# A router whose loop lags more than the header timeout (thousands of trickling clients on a
# starved machine) could cut a head that had arrived: the timeouts grow with the crowd.
HEADER_S = 2.0 + SLOW_CLIENTS / 256
BODY_S = HEADER_S + 1.0


async def _slow_client(port: int, body: bool) -> tuple[bytes, float]:
    """A client trickling its head (or, after a whole head, its body) until the router closes."""
    started = time.monotonic()  # before connecting: the router's clock starts at its accept, later
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if body:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    else:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    read = asyncio.ensure_future(reader.read())
    try:
        while not read.done():
            await asyncio.wait([read], timeout=0.5)
            if not read.done():
                writer.write(b'"x": 1, ' if body else b"X-Slow: 1\r\n")
        try:
            answer = read.result()
        except ConnectionResetError:  # closed while it was still sending: cut all the same
            answer = b""
        return answer, time.monotonic() - started
    finally:
        read.cancel()
        writer.close()


async def test_slow_clients_cannot_stop_valid_requests_and_are_cut_at_their_timeouts():
    async with emulated_replicas(1) as (rep,):
        router = await RouterProcess.start(
            [rep.url], "--max-in-flight", "20", "--header-timeout-s", str(HEADER_S), "--body-timeout-s", str(BODY_S)
        )
        try:
            slow = [asyncio.create_task(_slow_client(router.port, body=i % 2 == 1)) for i in range(2 * SLOW_CLIENTS)]
            await asyncio.sleep(1.0)  # all connected and stalling
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}
            latencies = []
            async with aiohttp.ClientSession() as session:
                for _ in range(30):
                    t = time.monotonic()
                    async with session.post(router.url + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                    latencies.append(time.monotonic() - t)
            results = await asyncio.wait_for(asyncio.gather(*slow), 60)
            for i, (answer, took) in enumerate(results):
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), (i, answer[:200])
                limit = BODY_S if i % 2 else HEADER_S
                assert limit * 0.8 < took < limit + 20, (i, took, answer[:100])
            answered = [sum(a.startswith(b"HTTP/1.1 408 ") for a, _ in results[k::2]) for k in (0, 1)]
            # the 408 is sent, then a lingering close (FIN, input ignored): clients still sending read it
            assert min(answered) >= SLOW_CLIENTS * 0.9, answered
            latencies.sort()
            print(f"\n{SLOW_CLIENTS} slowloris + {SLOW_CLIENTS} slow bodies: 30/30 valid requests served, "
                  f"p50 {latencies[15] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms; slow ones cut after "
                  f"{max(t for _, t in results[::2]):.1f} s (head, {answered[0]} saw the 408) / "
                  f"{max(t for _, t in results[1::2]):.1f} s (body, {answered[1]} saw the 408)")
        finally:
            await router.stop()


# -- a chat too long by its message count --------------------------------------------------------
def _many_messages(n: int, content: str = "x") -> bytes:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


async def test_a_chat_of_200k_messages_is_refused_from_its_roles_and_a_valid_long_one_is_served():
    """The issue's case: 200,000 one-character messages (7 MB, 1.2 M tokens for the tiny template)
    against the replica's 32,768 tokens.  Rendered and tokenized, each took 1.7-2.2 s here and four
    at once 5.7-6.7 s, /health stalled up to 1.3 s; counted from their roles (two special tokens
    each), four at once are refused in well under a second.  A chat of 4,000 short messages (over
    64 KB, under the limit) is still served."""
    async with emulated_replicas(1) as (rep,):
        router = await RouterProcess.start([rep.url])
        try:
            body = _many_messages(200_000)
            async with aiohttp.ClientSession() as session:

                async def post(data: bytes) -> tuple[int, dict[str, Any], float]:
                    started = time.perf_counter()
                    async with session.post(router.url + "/v1/chat/completions", data=data,
                                            headers={"Content-Type": "application/json"}) as resp:
                        return resp.status, await resp.json(), time.perf_counter() - started

                await post(_many_messages(2))  # connections and the first request's costs paid
                answers, latencies = await health_while(router.url, asyncio.gather(*(post(body) for _ in range(4))))
                for status, answer, took in answers:
                    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
                    assert "at least 399998 tokens long (200000 messages" in answer["error"]["message"]  # not rendered
                    assert took < 2.0, took
                assert max(latencies) < 2.0, latencies  # a loose bound: this machine is shared (the refusal itself is checked above)
                status, answer, _ = await post(_many_messages(4_000, "hi there"))
                assert status == 200, answer
        finally:
            await router.stop()
