"""The client-connection cap (router/edge/connections.py, docs/design.md §7.5): at the cap a new
connection evicts the connection idle the longest, or is answered 503 when none is idle; a request
in progress is never cut; the soft open-file limit is raised at start.  A real router and real
emulated replicas, raw sockets and the openai client; a router process under ``prlimit`` with
1,024 open files serves valid requests while a thousand idle connections are held."""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import subprocess
import sys
import time

import openai
import pytest

from kvroute.router.edge.connections import RESERVED_FILES, ConnectionBook, connection_cap, raise_open_file_limit
from tests.router_support import (
    MODEL, REPO, RouterProcess, emulated_replicas, openai_client, running_router, scrape,
)

CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


async def idle_connection(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keep-alive connection that asked for /health once and is now silent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1])
    await reader.readexactly(length)
    return reader, writer


async def closed_by_router(reader: asyncio.StreamReader, within_s: float = 2.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def shed(metrics: dict, action: str) -> float:
    return metrics[("kvroute_client_connections_shed_total", (("action", action),))]


async def test_at_the_cap_the_longest_idle_connection_makes_room():
    async with emulated_replicas(1) as reps, running_router([reps[0].url], max_client_connections=4) as app:
        conns = [await idle_connection(app.port) for _ in range(4)]
        metrics = await scrape(app.url)  # a fifth connection: the oldest idle one makes room
        assert shed(metrics, "evicted") == 1 and metrics[("kvroute_client_connections_limit", ())] == 4
        assert await closed_by_router(conns[0][0])
        conns.append(await idle_connection(app.port))  # the scrape's connection closed: room for one
        # a valid chat on a new connection is served; the next oldest idle connection is closed
        answer = await openai_client(app).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                                   max_tokens=2)
        assert answer.choices[0].message.content is not None
        assert await closed_by_router(conns[1][0])
        # the connections that were used most recently are still served
        reader, writer = conns[4]
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        for _, w in conns:
            w.close()


async def test_requests_in_progress_are_never_evicted_and_a_new_connection_gets_503():
    async with emulated_replicas(1, time_scale=1.0) as reps, running_router(
        [reps[0].url], max_client_connections=3, header_timeout_s=5.0
    ) as app:
        # three connections each part-way through a request (a head still arriving): none is idle
        busy = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            busy.append((reader, writer))
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "server_busy" and "limit" in error["message"]
        writer.close()
        # each of them finishes its request, answered in full
        for reader, writer in busy:
            writer.write(b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(CHAT)
                         + CHAT)
        for reader, writer in busy:
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            writer.close()
        metrics = await scrape(app.url)
        assert shed(metrics, "refused") == 1 and shed(metrics, "evicted") == 0


def test_the_cap_leaves_room_below_the_open_file_limit():
    assert connection_cap(1024, 1024) == (1024 - RESERVED_FILES) // 2  # an upstream connection each
    assert connection_cap(1_048_576, 1024) == 1_048_576 - RESERVED_FILES - 1024
    assert connection_cap(300, 10) == 300 - RESERVED_FILES - 10
    assert connection_cap(100, 1024) >= 1  # a tiny limit still serves


def test_the_book_evicts_the_longest_idle_first():
    class Conn:
        def __init__(self, name: str):
            self.name, self.evicted = name, False

        def evict(self) -> None:
            self.evicted = True

    book = ConnectionBook(2)
    a, b, c, d = (Conn(n) for n in "abcd")
    assert book.opened(a) and book.opened(b)
    book.busy(a)
    book.idle(a)  # a answered a request after b was accepted: b has been idle longer
    assert book.opened(c) and b.evicted and not a.evicted
    book.closed(b)
    book.busy(a)
    book.busy(c)
    assert not book.opened(d) and book.refused == 1  # both busy: the new one is refused
    book.closed(d)
    assert book.open == 2 and book.evicted == 1


def test_the_soft_open_file_limit_is_raised_to_the_hard_one():
    """In a child process whose soft limit is 1,024 and hard limit 4,096 (prlimit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.fail(f"this test needs a hard open-file limit of at least 4096 (it is {hard})")
    code = ("from kvroute.router.edge.connections import raise_open_file_limit as r; import resource; "
            "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run(["prlimit", "--nofile=1024:4096", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(REPO), check=True).stdout.strip()
    assert out == "(1024, 4096, 4096) (4096, 4096)"
    assert raise_open_file_limit()[1] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
async def test_a_thousand_idle_connections_do_not_stop_a_router_with_1024_open_files():
    """The issue's case: 1,000 idle keep-alive connections against a router process whose soft and
    hard open-file limits are 1,024.  Without the cap every new connection was accepted and closed
    unanswered (EMFILE) for the keep-alive timeout; with it, valid chats and /metrics are served
    throughout, and the idle connections are evicted to make room."""
    async with emulated_replicas(1) as reps:
        router = await RouterProcess.start([reps[0].url], "--no-access-log", prefix=["prlimit", "--nofile=1024:1024"])
        try:
            conns = []
            for _ in range(1000):
                try:
                    conns.append(await idle_connection(router.port))
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass  # evicted while the next ones were opened
            client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            started = time.monotonic()
            for _ in range(10):
                answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                              max_tokens=2)
                assert answer.choices[0].message.content is not None
                metrics = await scrape(router.url)
            assert time.monotonic() - started < 10
            await client.close()
            limit = metrics[("kvroute_client_connections_limit", ())]
            assert limit == connection_cap(1024, 1024)
            assert shed(metrics, "evicted") >= 1000 - limit and shed(metrics, "refused") == 0
            for _, w in conns:
                w.close()
        finally:
            await router.stop()
