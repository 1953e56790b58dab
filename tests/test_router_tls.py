"""TLS with certificates made for the test (tests/tls_support.py): the openai client against the
router over HTTPS (one process, and --workers 2), the router against https emulated replicas with
a CA bundle, mutual TLS both ways, and the startup errors of files that cannot be used."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import sys
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvroute.router.app import RouterApp
from kvroute.router.main import main
from tests.conftest import free_port
from tests.router_support import MODEL, REPO, TINY_TOKENIZER, RouterProcess, emulated_replicas, running_router
from tests.tls_support import FLEET_NAME, Pki, make_pki

HELLO = [{"role": "user", "content": "Hello over TLS."}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def https_client(url: str, ca) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client trusting only ``ca``."""
    trust = ssl.create_default_context(cafile=str(ca))
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=trust)) as client:
        yield client


async def chat(client: openai.AsyncOpenAI) -> str:
    reply = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    return reply.choices[0].message.content


async def test_the_openai_client_reaches_the_router_over_https(pki):
    async with emulated_replicas(1) as reps, running_router(
        [reps[0].url], tls_cert_file=pki.server_cert, tls_key_file=pki.server_key
    ) as app:
        assert app.url.startswith("https://127.0.0.1:")
        async with https_client(app.url, pki.ca) as client:
            assert await chat(client)
            stream = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        async with https_client(app.url, pki.other_ca) as stranger:  # the router's certificate is not its CA's
            with pytest.raises(openai.APIConnectionError):
                await chat(stranger)
        async with aiohttp.ClientSession() as plain:  # plain HTTP on the TLS port gets no answer
            with pytest.raises(aiohttp.ClientError):
                await plain.get(app.url.replace("https", "http") + "/health")


async def test_a_client_that_never_finishes_the_tls_handshake_is_closed_at_the_header_timeout(pki):
    """The header timeout starts once TLS is up: the handshake is bounded by it too (asyncio alone
    would give it 60 s)."""
    async with emulated_replicas(1) as reps, running_router(
        [reps[0].url], tls_cert_file=pki.server_cert, tls_key_file=pki.server_key, header_timeout_s=1.0
    ) as app:
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)  # TCP, then silence
        try:
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 15) == b""  # closed by the router
            assert asyncio.get_running_loop().time() - started < 15
        finally:
            writer.close()
        async with https_client(app.url, pki.ca) as client:  # a client that does finish it is served
            assert await chat(client)


async def test_every_worker_serves_https(pki):
    async with emulated_replicas(1) as reps:
        router = await RouterProcess.start(
            [reps[0].url], "--port", str(free_port()), "--workers", "2",
            "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
        )
        try:
            assert router.url.startswith("https://")
            async with https_client(router.url, pki.ca) as client:  # new connections: the kernel spreads them
                answers = await asyncio.gather(*(chat(client) for _ in range(8)))
            assert all(answers)
        finally:
            await router.stop()


async def test_the_router_reaches_https_replicas_with_a_ca_bundle(pki):
    tls = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key)}
    async with emulated_replicas(2, **tls) as reps:
        urls = [r.url for r in reps]
        assert all(u.startswith("https://") for u in urls)
        async with running_router(urls, fleet={"replica_ca_file": pki.ca}) as app:
            ready = await _ready(app)  # the probes: /health and /v1/models over TLS
            assert ready["replicas"] == 2 and app.fleet.models() and MODEL in app.fleet.models()
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                assert await chat(client)
                assert [m.id async for m in client.models.list()] == [MODEL]
        # without the bundle the replicas' certificates are not trusted: no replica, and a clear answer
        async with running_router(urls) as app:
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                with pytest.raises(openai.APIStatusError) as untrusted:
                    await chat(client)
            assert untrusted.value.status_code == 502 and untrusted.value.body["code"] == "upstream_tls_failed"
            assert "certificate verify failed" in untrusted.value.body["message"]


async def test_replicas_found_by_address_are_checked_against_one_fleet_name(pki):
    """A certificate that names the fleet, not each replica's address: verified against
    fleet.replica_server_name (probes and requests alike), refused without it."""
    tls = {"ssl_certfile": str(pki.fleet_cert), "ssl_keyfile": str(pki.fleet_key)}
    async with emulated_replicas(1, **tls) as reps:
        named = {"replica_ca_file": pki.ca, "replica_server_name": FLEET_NAME}
        async with running_router([reps[0].url], fleet=named) as app:
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                assert await chat(client)
        async with running_router([reps[0].url], fleet={"replica_ca_file": pki.ca}) as app:
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                with pytest.raises(openai.APIStatusError) as mismatch:
                    await chat(client)
            assert mismatch.value.status_code == 502 and "IP address mismatch" in mismatch.value.body["message"]


async def test_mutual_tls(pki):
    tls = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key),
           "ssl_ca_certs": str(pki.ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    async with emulated_replicas(1, **tls) as reps:
        url = reps[0].url
        mtls = {"replica_ca_file": pki.ca, "replica_client_cert_file": pki.client_cert,
                "replica_client_key_file": pki.client_key}
        async with running_router([url], fleet=mtls) as app:
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                assert await chat(client)
        async with running_router([url], fleet={"replica_ca_file": pki.ca}) as app:  # no client certificate
            async with openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0) as client:
                with pytest.raises(openai.APIStatusError) as refused:
                    await chat(client)
            assert refused.value.status_code == 502 and refused.value.body["code"] == "upstream_tls_failed"
            assert "fleet.replica_client_cert_file" in refused.value.body["message"]


async def test_the_router_images_health_check_speaks_https_when_the_router_does(pki):
    """Dockerfile.router's HEALTHCHECK, run as Docker runs it (its exec form, the image's variables),
    against an HTTPS router: https with KVROUTE_TLS_CERT_FILE set, and plain http fails there."""
    line = next(x for x in (REPO / "deploy" / "Dockerfile.router").read_text().replace("\\\n", " ").splitlines()
                if x.startswith("HEALTHCHECK"))
    command = json.loads(line.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    async with emulated_replicas(1) as reps, running_router(
        [reps[0].url], tls_cert_file=pki.server_cert, tls_key_file=pki.server_key
    ) as app:
        async def check(**env: str) -> int:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *command[1:], env={"PATH": os.environ["PATH"], "KVROUTE_PORT": str(app.port), **env},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            return await asyncio.wait_for(proc.wait(), 30)

        assert await check(KVROUTE_TLS_CERT_FILE=str(pki.server_cert)) == 0
        assert await check() != 0


@pytest.mark.parametrize("case", ["missing cert", "missing key", "key of another cert", "only a cert", "missing ca"])
def test_files_that_cannot_be_used_stop_the_router_with_a_clear_error(pki, tmp_path, capsys, case):
    argv = ["--host", "127.0.0.1", "--port", "0", "--tokenizer", TINY_TOKENIZER, "--replicas", "http://127.0.0.1:9"]
    flags = {
        "missing cert": ["--tls-cert-file", str(tmp_path / "nope.crt"), "--tls-key-file", str(pki.server_key)],
        "missing key": ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(tmp_path / "nope.key")],
        "key of another cert": ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.client_key)],
        "only a cert": ["--tls-cert-file", str(pki.server_cert)],
        "missing ca": ["--fleet.replica-ca-file", str(tmp_path / "nope-ca.pem")],
    }[case]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    expected = {
        "missing cert": f"--tls-cert-file {tmp_path / 'nope.crt'}: no such file",
        "missing key": f"--tls-key-file {tmp_path / 'nope.key'}: no such file",
        "key of another cert": "not a PEM certificate and its matching private key",
        "only a cert": "tls_cert_file and tls_key_file go together",
        "missing ca": f"--fleet.replica-ca-file {tmp_path / 'nope-ca.pem'}: no such file",
    }[case]
    assert expected in err, err
    assert "Traceback" not in err


async def _ready(app: RouterApp) -> dict:
    async with aiohttp.ClientSession() as s, s.get(app.url + "/ready") as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_tls_settings_from_the_environment(pki, monkeypatch):
    from kvroute.router.config import load_settings

    monkeypatch.setenv("KVROUTE_TLS_CERT_FILE", str(pki.server_cert))
    monkeypatch.setenv("KVROUTE_TLS_KEY_FILE", str(pki.server_key))
    monkeypatch.setenv("KVROUTE_FLEET__REPLICA_CA_FILE", str(pki.ca))
    monkeypatch.setenv("KVROUTE_FLEET__REPLICA_CLIENT_CERT_FILE", "")  # a chart's or compose's empty variable: unset
    settings = load_settings([])
    assert settings.tls_cert_file == pki.server_cert and settings.tls_key_file == pki.server_key
    assert settings.fleet.replica_ca_file == pki.ca and settings.fleet.replica_client_cert_file is None
    monkeypatch.setenv("KVROUTE_FLEET__REPLICA_CLIENT_CERT_FILE", str(pki.client_cert))
    with pytest.raises(ValueError, match="replica_client_cert_file and fleet.replica_client_key_file go together"):
        load_settings([])
