"""Real vLLM replicas for tests: each one is `kvroute replica --engine vllm` in a subprocess.

pytest runs in the router's environment; the launcher runs there too, and starts vLLM with the
vLLM environment's Python ($KVROUTE_VLLM_PYTHON, else .venv-vllm).  A replica takes ~20 s of CPU
to start and ~1.2 GB, so the pool starts several at once (on 2 cores, concurrent starts overlap
their idle time) and keeps them for the whole session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
BLOCK_SIZE = 32  # vLLM on CPU: a multiple of 32
SMALL_KV_BLOCKS = 64  # conftest's small_kv_replica: 2048 tokens, so a few prompts evict each other
SMALL_KV_MAX_MODEL_LEN = 1024  # vLLM refuses a max_model_len its KV cache cannot hold
READY_TIMEOUT_S = 420.0  # a start under load (other tests, other replicas starting) takes minutes


def vllm_python() -> Path:
    explicit = os.environ.get("KVROUTE_VLLM_PYTHON")
    return Path(explicit) if explicit else REPO / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True)
class ReplicaOptions:
    kv_cache_bytes: str = "64M"
    num_gpu_blocks: int | None = None  # exact capacity in blocks (--num-gpu-blocks-override)
    max_model_len: int | None = None  # must fit the KV cache: vLLM refuses to start otherwise
    block_size: int = BLOCK_SIZE
    extra_args: tuple[str, ...] = ()  # more `kvroute replica` flags


@dataclass
class LaunchedReplica:
    key: str
    options: ReplicaOptions
    port: int
    events_port: int
    replay_port: int
    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    vllm_log_path: Path
    # Filled in from the launcher's ready line:
    url: str = ""
    block_size: int = 0
    capacity_blocks: int = 0
    events_endpoint: str = ""
    replay_endpoint: str = ""
    vllm_pid: int | None = None  # vLLM's API server: also its process group id
    ready: bool = field(default=False)

    @property
    def model(self) -> str:
        return MODEL

    def logs(self, tail: int = 40) -> str:
        parts = []
        for path in (self.stderr_path, self.vllm_log_path):
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    def vllm_group_alive(self) -> bool:
        """Whether any process of vLLM's process group still runs (zombies do not count: an
        orphan's reaping is up to whatever PID 1 is)."""
        return self.vllm_pid is not None and bool(group_members(self.vllm_pid))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        state, _ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(text.split(" ", 1)[0]))
    return members


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _parse_ready_line(line: str, replica: LaunchedReplica) -> None:
    """`URL model=M block_size=B num_gpu_blocks=N [events E] [replay R]` (as the emulated replica prints)."""
    words = line.split()
    replica.url = words[0]
    fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    replica.block_size = int(fields["block_size"])
    replica.capacity_blocks = int(fields["num_gpu_blocks"])
    for key in ("events", "replay"):
        if key in words:
            setattr(replica, f"{key}_endpoint", words[words.index(key) + 1])


class ReplicaPool:
    def __init__(self, workdir: Path, model_dir: Path, redis_url: str, key_prefix: str) -> None:
        self.workdir = workdir
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.replicas: dict[str, LaunchedReplica] = {}
        self._starts: dict[str, int] = {}

    def spawn(self, key: str, options: ReplicaOptions = ReplicaOptions(), *, ports: tuple[int, int, int] | None = None) -> LaunchedReplica:
        """Start a launcher (returns at once; ``get`` waits for it).  No-op if ``key`` runs."""
        if key in self.replicas and self.replicas[key].proc.poll() is None:
            return self.replicas[key]
        port, events_port, replay_port = ports or (free_port(), free_port(), free_port())
        n = self._starts[key] = self._starts.get(key, 0) + 1
        stem = self.workdir / f"{key}-{n}"
        cmd = [
            sys.executable, "-m", "router.cli", "replica", "--engine", "vllm",
            "--model", MODEL, "--model-path", str(self.model_dir), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(options.block_size), "--kv-cache-bytes", options.kv_cache_bytes,
            "--events-endpoint", f"tcp://*:{events_port}", "--replay-endpoint", f"tcp://*:{replay_port}",
            "--redis-url", self.redis_url, "--redis-key-prefix", self.key_prefix,
            "--registration-ttl", "10", "--drain-grace", "0.5",
            "--vllm-python", str(vllm_python()), "--vllm-log", f"{stem}.vllm.log",
        ]
        if options.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks", str(options.num_gpu_blocks)]
        if options.max_model_len is not None:
            cmd += ["--max-model-len", str(options.max_model_len)]
        cmd += list(options.extra_args)
        stdout_path, stderr_path = Path(f"{stem}.out"), Path(f"{stem}.err")
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        replica = LaunchedReplica(key, options, port, events_port, replay_port, proc, stdout_path, stderr_path,
                                  Path(f"{stem}.vllm.log"))
        self.replicas[key] = replica
        return replica

    def get(self, key: str, timeout: float = READY_TIMEOUT_S) -> LaunchedReplica:
        """The replica, once its launcher said it is ready (healthy and registered)."""
        replica = self.replicas[key]
        deadline = time.monotonic() + timeout
        while not replica.ready:
            text = replica.stdout_path.read_text(errors="replace")
            line = next((ln for ln in text.splitlines() if " model=" in ln), None)
            if line is not None:
                _parse_ready_line(line, replica)
                vllm = _children(replica.proc.pid)
                replica.vllm_pid = vllm[0] if vllm else None
                replica.ready = True
                break
            if replica.proc.poll() is not None:
                raise RuntimeError(f"replica {key} exited with code {replica.proc.returncode} before it was "
                                   f"ready\n{replica.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {key} not ready after {timeout:.0f} s\n{replica.logs()}")
            time.sleep(0.5)
        return replica

    def restart(self, key: str) -> LaunchedReplica:
        """Stop the replica and start a new one on the same ports (a replica restart, as routers see it)."""
        old = self.replicas[key]
        self.stop(key)
        self.spawn(key, old.options, ports=(old.port, old.events_port, old.replay_port))
        return self.get(key)

    def stop(self, key: str, timeout: float = 60.0) -> int:
        """SIGTERM the launcher (it deregisters, drains, stops vLLM); returns its exit code."""
        replica = self.replicas[key]
        if replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGTERM)
            try:
                replica.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait()
        if replica.vllm_group_alive():  # a launcher that failed to stop it: never leave vLLM behind
            os.killpg(replica.vllm_pid, signal.SIGKILL)  # type: ignore[arg-type]
        return replica.proc.returncode

    def stop_all(self) -> None:
        running = [k for k, r in self.replicas.items() if r.proc.poll() is None]
        for key in running:  # SIGTERM all first: they stop in parallel
            self.replicas[key].proc.send_signal(signal.SIGTERM)
        for key in self.replicas:
            self.stop(key)
