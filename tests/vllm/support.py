"""Real vLLM replicas for tests: each one is `kvroute replica --engine vllm` in a subprocess,
launched and stopped by replica/vllm_fleet.py (which `kvroute demo --engine vllm` uses too).

pytest runs in the router's environment; the launcher runs there too, and starts vLLM with the
vLLM environment's Python ($KVROUTE_VLLM_PYTHON, else .venv-vllm).  A replica takes ~20 s of CPU
to start and ~1.2 GB, so the pool starts several at once (on 2 cores, concurrent starts overlap
their idle time) and keeps them for the whole session.
"""

from __future__ import annotations

from pathlib import Path

from kvroute.replica.vllm_fleet import (
    BLOCK_SIZE,
    REPO,
    FleetError,
    LaunchedReplica,
    ReplicaOptions,
    group_members,
    spawn,
    vllm_python,
    wait_ready,
)
from tests.conftest import free_port

__all__ = ["BLOCK_SIZE", "MODEL", "REPO", "SMALL_KV_BLOCKS", "SMALL_KV_MAX_MODEL_LEN", "LaunchedReplica",
           "ReplicaOptions", "ReplicaPool", "group_members", "vllm_python"]

MODEL = "tiny"
SMALL_KV_BLOCKS = 64  # conftest's small_kv_replica: 2048 tokens, so a few prompts evict each other
SMALL_KV_MAX_MODEL_LEN = 1024  # vLLM refuses a max_model_len its KV cache cannot hold
READY_TIMEOUT_S = 420.0  # a start under load (other tests, other replicas starting) takes minutes


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
        registration = [
            "--events-endpoint", f"tcp://*:{events_port}", "--replay-endpoint", f"tcp://*:{replay_port}",
            "--redis-url", self.redis_url, "--redis-key-prefix", self.key_prefix,
            "--registration-ttl", "10", "--drain-grace", "0.5",
        ]
        replica = spawn(key, MODEL, self.model_dir, options, self.workdir / f"{key}-{n}", port=port,
                        more=registration, events_port=events_port, replay_port=replay_port)
        self.replicas[key] = replica
        return replica

    def get(self, key: str, timeout: float = READY_TIMEOUT_S) -> LaunchedReplica:
        """The replica, once its launcher said it is ready (healthy and registered).  A replica whose
        ports, picked free, were taken before vLLM bound them (other processes on a shared machine)
        is started again on fresh ones, twice at most; any other failure is the test's."""
        for attempt in range(3):
            replica = self.replicas[key]
            try:
                wait_ready(replica, timeout)
                return replica
            except FleetError:
                log = replica.vllm_log_path.read_text(errors="replace") if replica.vllm_log_path.exists() else ""
                if attempt == 2 or "Address already in use" not in log:
                    raise
                self.spawn(key, replica.options)
        raise AssertionError("unreachable")

    def restart(self, key: str) -> LaunchedReplica:
        """Stop the replica and start a new one on the same ports (a replica restart, as routers see it)."""
        old = self.replicas[key]
        self.stop(key)
        assert old.events_port is not None and old.replay_port is not None
        self.spawn(key, old.options, ports=(old.port, old.events_port, old.replay_port))
        return self.get(key)

    def stop(self, key: str, timeout: float = 60.0) -> int:
        """SIGTERM the launcher (it deregisters, drains, stops vLLM); returns its exit code."""
        return self.replicas[key].stop(timeout)

    def stop_all(self) -> None:
        for replica in self.replicas.values():  # SIGTERM all first: they stop in parallel
            replica.terminate()
        for key in self.replicas:
            self.stop(key)
