"""Kubernetes discovery (router/fleet/discovery/k8s.py) against the pod list+watch protocol of the API
server, served on loopback by tests/kube_api.py (no kube-apiserver can run here: see there), with
the real kubernetes_asyncio client reading a real kubeconfig; and end to end, a router that finds
emulated replicas this way and routes the official openai client's requests to them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from kvroute.router.fleet.discovery import K8sSource
from kvroute.router.fleet.discovery import k8s as k8s_module
from tests.kube_api import KubeApiServer, go_bool, make_pod, self_signed_tls
from tests.router_support import MODEL, openai_client, running_router, sample, scrape, total
from tests.test_fleet import until

SELECTOR = "app=vllm,model=qwen2-5-0-5b"
LABELS = {"app": "vllm", "model": "qwen2-5-0-5b"}


@pytest.fixture
async def kube_api():
    server = await KubeApiServer().start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(kube_api: KubeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # as outside a cluster
    path = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


@pytest.fixture
async def sources():
    made: list[K8sSource] = []

    def make(selector: str = SELECTOR, **kwargs) -> K8sSource:
        source = K8sSource(selector, **{"backoff_s": (0.05, 0.2), **kwargs})
        made.append(source)
        return source

    yield make
    for s in made:
        await s.close()


async def until_listed(source: K8sSource, expected: set[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (listed := set(await source.list())) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"listed {sorted(listed)}, expected {sorted(expected)}")
        await asyncio.sleep(0.02)


def counted(source: K8sSource, name: str, **labels: str) -> float:
    """A counter of the source's metrics (by its attribute), summed over the series with ``labels``."""
    want = {"source": "k8s", **labels}.items()
    return sum(
        s.value
        for family in getattr(source.metrics, name).collect()
        for s in family.samples
        if s.name.endswith("_total") and want <= s.labels.items()
    )


def lists(api: KubeApiServer) -> int:
    return sum(kind == "list" for kind, _ in api.requests)


# -- what a pod must be to be a replica ---------------------------------------------------------
async def test_ready_pods_appear_and_leave_when_not_ready_terminating_or_deleted(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    kube_api.create(make_pod("vllm-b", "10.244.3.42", 8000, labels=LABELS, ready=False))
    kube_api.create(make_pod("vllm-other", "10.244.3.43", 8000, labels={"app": "vllm", "model": "other"}))
    pending = make_pod("vllm-pending", "", 8000, labels=LABELS, ready=False)
    pending["status"].update(phase="Pending", podIPs=[])
    kube_api.create(pending)
    source = sources()

    # the first call waits for the first list: a router starts with its pods
    assert set(await source.list()) == {"http://10.244.3.41:8000"}
    assert source.namespace == "llm"  # the kubeconfig context's

    kube_api.set_ready("vllm-b", True)
    await until_listed(source, {"http://10.244.3.41:8000", "http://10.244.3.42:8000"})
    kube_api.set_ready("vllm-a", False)  # its readiness probe fails
    await until_listed(source, {"http://10.244.3.42:8000"})
    kube_api.set_ready("vllm-a", True)
    await until_listed(source, {"http://10.244.3.41:8000", "http://10.244.3.42:8000"})
    kube_api.terminate("vllm-a")  # deletionTimestamp set, still Ready: leaving all the same
    await until_listed(source, {"http://10.244.3.42:8000"})
    kube_api.delete("vllm-a")
    kube_api.delete("vllm-b")
    await until_listed(source, set())
    kube_api.create(make_pod("vllm-c", "fd00::7", 8000, labels=LABELS))
    await until_listed(source, {"http://[fd00::7]:8000"})
    # all of it from one list and its watch, and only the selected pods were sent
    assert lists(kube_api) == 1
    assert counted(source, "events", type="ADDED") == 1  # vllm-c; not vllm-other
    assert counted(source, "errors") == 0


async def test_the_replica_port_is_the_named_container_port_else_the_fallback(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-api", "10.244.0.5", 9000, labels=LABELS, port_name="openai"))
    kube_api.create(make_pod("vllm-http", "10.244.0.6", 8000, labels=LABELS))
    named = sources(port_name="openai")
    assert set(await named.list()) == {"http://10.244.0.5:9000"}  # vllm-http has no port of that name
    fallback = sources(port_name="openai", port=8080)
    assert set(await fallback.list()) == {"http://10.244.0.5:9000", "http://10.244.0.6:8080"}
    default = sources()
    assert set(await default.list()) == {"http://10.244.0.6:8000"}


async def test_a_long_list_is_read_in_pages(kube_api, kubeconfig, sources, monkeypatch):
    monkeypatch.setattr(k8s_module, "LIST_PAGE", 3)
    for i in range(7):
        kube_api.create(make_pod(f"vllm-{i}", f"10.244.1.{i + 1}", 8000, labels=LABELS))
    source = sources()
    assert len(await source.list()) == 7
    pages = [q for kind, q in kube_api.requests if kind == "list"]
    assert [q.get("continue") is not None for q in pages] == [False, True, True]
    assert all(q["limit"] == "3" for q in pages)


# -- the watch's resourceVersion ----------------------------------------------------------------
async def test_a_watch_that_times_out_resumes_from_its_resource_version(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    source = sources(watch_timeout_s=0.5)  # the server ends each watch after 0.5-1 s
    await until_listed(source, {"http://10.244.3.41:8000"})
    await until(lambda: sum(kind == "watch" for kind, _ in kube_api.requests) >= 3)
    kube_api.create(make_pod("vllm-b", "10.244.3.42", 8000, labels=LABELS))
    await until_listed(source, {"http://10.244.3.41:8000", "http://10.244.3.42:8000"})
    watches = [q for kind, q in kube_api.requests if kind == "watch"]
    assert lists(kube_api) == 1  # no re-list: each watch went on from the last version it saw
    assert all(go_bool(q["allowWatchBookmarks"]) and int(q["timeoutSeconds"]) >= 1 for q in watches)
    assert watches[0]["resourceVersion"] == "1001"  # the list's version


async def test_an_expired_watch_lists_again_and_catches_up(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    kube_api.create(make_pod("vllm-b", "10.244.3.42", 8000, labels=LABELS))
    source = sources()
    await until_listed(source, {"http://10.244.3.41:8000", "http://10.244.3.42:8000"})
    await until(lambda: kube_api._watchers != set())
    # the watch falls behind while pods change, the history is compacted, and the API server
    # tells the watcher so (ERROR 410): only a new list can bring it up to date
    kube_api.stall_watches()
    kube_api.delete("vllm-a")
    kube_api.create(make_pod("vllm-c", "10.244.3.43", 8000, labels=LABELS))
    kube_api.compact()
    await kube_api.end_watches(expired=True)
    await until_listed(source, {"http://10.244.3.42:8000", "http://10.244.3.43:8000"})
    assert counted(source, "relists", reason="expired") == 1
    assert lists(kube_api) == 2
    assert counted(source, "errors") == 0  # an expiry is the protocol, not an error


async def test_a_version_compacted_between_watches_lists_again_unless_a_bookmark_moved_it(
    kube_api, kubeconfig, sources
):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    source = sources()
    await until_listed(source, {"http://10.244.3.41:8000"})

    async def unrelated_churn_then_reconnect() -> None:
        # other pods change: the version moves on, but this selector's watch sees no event
        await until(lambda: kube_api._watchers != set())
        for i in range(5):
            kube_api.create(make_pod(f"other-{i}", f"10.244.9.{i}", 8000, labels={"app": "web"}))
        if kube_api.bookmark_interval_s:  # wait until the router has read a bookmark of the new version
            churned = kube_api.version
            await until(lambda: any(v >= churned for v in kube_api.bookmarks))
            needed = next(i for i, v in enumerate(kube_api.bookmarks) if v >= churned) + 1
            await until(lambda: counted(source, "events", type="BOOKMARK") >= needed)
        kube_api.compact()
        await kube_api.end_watches()  # a plain end, as at timeoutSeconds

    # without bookmarks the watch's version is the list's, now compacted: 410 on reconnect
    await unrelated_churn_then_reconnect()
    await until(lambda: counted(source, "relists", reason="expired") == 1)
    await until(lambda: kube_api._watchers != set())
    # with bookmarks the version follows the API server's, and the reconnect needs no list
    kube_api.bookmark_interval_s = 0.05
    await kube_api.end_watches()  # the next watch gets bookmarks
    await unrelated_churn_then_reconnect()
    await until(lambda: sum(kind == "watch" for kind, _ in kube_api.requests) >= 5)
    assert counted(source, "relists", reason="expired") == 1
    assert lists(kube_api) == 2
    assert set(await source.list()) == {"http://10.244.3.41:8000"}


async def test_an_api_server_expiring_every_watch_is_listed_at_a_bounded_rate(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    source = sources(backoff_s=(0.2, 1.0))
    await until_listed(source, {"http://10.244.3.41:8000"})
    kube_api.compacted_at = 10**9  # every watch is answered 410 Gone
    await kube_api.end_watches()
    before = lists(kube_api)
    await asyncio.sleep(1.0)
    assert 1 <= lists(kube_api) - before <= 6  # lists 0.2 s apart at least, not a busy loop
    assert set(await source.list()) == {"http://10.244.3.41:8000"}


# -- failures -------------------------------------------------------------------------------
async def test_an_api_outage_keeps_the_pods_and_recovers_with_backoff(kube_api, kubeconfig, sources):
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    kube_api.create(make_pod("vllm-b", "10.244.3.42", 8000, labels=LABELS))
    source = sources()
    both = {"http://10.244.3.41:8000", "http://10.244.3.42:8000"}
    await until_listed(source, both)

    await kube_api.stop()  # connections refused
    await until(lambda: counted(source, "errors", error="connection") >= 1)
    kube_api.delete("vllm-b")  # changes the router cannot see meanwhile
    kube_api.create(make_pod("vllm-c", "10.244.3.43", 8000, labels=LABELS))
    before = counted(source, "errors", error="connection")
    await asyncio.sleep(1.0)
    assert set(await source.list()) == both  # the last listing is kept, never emptied
    # backoff (0.05 s doubling to 0.2 s here): a handful of attempts a second, not a busy loop
    assert counted(source, "errors", error="connection") - before <= 15

    await kube_api.start()
    await until_listed(source, {"http://10.244.3.41:8000", "http://10.244.3.43:8000"})
    assert counted(source, "relists", reason="error") >= 1

    kube_api.fail_status = 503  # up, but answering errors
    await kube_api.end_watches()
    await until(lambda: counted(source, "errors", error="api") >= 2)
    assert set(await source.list()) == {"http://10.244.3.41:8000", "http://10.244.3.43:8000"}
    kube_api.fail_status = None
    kube_api.set_ready("vllm-a", False)
    await until_listed(source, {"http://10.244.3.43:8000"})


async def test_wrong_credentials_or_no_config_are_counted_errors_not_crashes(
    kube_api, tmp_path, monkeypatch, sources
):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kube_api.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    monkeypatch.setenv("KUBECONFIG", str(kube_api.write_kubeconfig(tmp_path / "bad", token="expired")))
    rejected = sources(timeout_s=0.3)
    assert await rejected.list() == {}
    await until(lambda: counted(rejected, "errors", error="api") >= 2)  # 401, retried

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    unconfigured = sources(timeout_s=0.3)
    assert await unconfigured.list() == {}
    await until(lambda: counted(unconfigured, "errors", error="config") >= 2)

    monkeypatch.setenv("KUBECONFIG", str(kube_api.write_kubeconfig(tmp_path / "good", namespace=None)))
    elsewhere = sources(timeout_s=0.3)  # a context without a namespace: "default", no pods there
    assert await elsewhere.list() == {}
    assert elsewhere.namespace == "default"
    given = sources(namespace="llm")
    assert set(await given.list()) == {"http://10.244.3.41:8000"}


async def test_in_a_cluster_the_service_account_reaches_the_api_server_over_verified_tls(
    tmp_path, monkeypatch, sources
):
    tls, cert = self_signed_tls(tmp_path / "ca")
    impostor_tls, _ = self_signed_tls(tmp_path / "impostor")  # a certificate the mounted CA did not sign
    api, impostor = KubeApiServer(tls=tls), KubeApiServer(tls=impostor_tls)
    for server in (api, impostor):
        await server.start()
        server.create(make_pod("vllm-a", "10.244.3.41", 8000, labels=LABELS))
    try:
        monkeypatch.delenv("KUBECONFIG", raising=False)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setattr(k8s_module, "SERVICE_ACCOUNT_DIR", api.write_service_account(tmp_path / "sa", cert))
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        source = sources()
        assert set(await source.list()) == {"http://10.244.3.41:8000"}
        assert source.namespace == "llm"  # the service account's

        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(impostor.port))
        refused = sources(timeout_s=0.3)
        assert await refused.list() == {}
        await until(lambda: counted(refused, "errors", error="connection") >= 1)
        assert impostor.requests == []  # no token or request reached it
    finally:
        await api.stop()
        await impostor.stop()


# -- end to end -----------------------------------------------------------------------------
async def test_a_router_routes_to_replicas_it_discovers_through_the_kubernetes_api(kube_api, kubeconfig):
    # two emulated vLLM replicas, each at its own loopback address as pods have their own IP
    reps = [EmulatedReplica(ReplicaConfig(model=MODEL, time_scale=0.0, host=f"127.0.0.{i}")) for i in (2, 3)]
    for r in reps:
        await r.start()
    try:
        a, b = reps
        kube_api.create(make_pod("vllm-a", "127.0.0.2", a.port, labels=LABELS))
        kube_api.create(make_pod("vllm-b", "127.0.0.3", b.port, labels=LABELS, ready=False))
        fleet = {"k8s_selector": SELECTOR, "health_interval_s": 0.2}
        async with running_router([], fleet=fleet) as app:
            client = openai_client(app)

            async def served_by(rep: EmulatedReplica) -> float:
                return total(await scrape(rep.url), "vllm:request_success_total")

            await until(lambda: [r.name for r in app.fleet.eligible(MODEL)] == [a.url])
            assert app.fleet.get(a.url).sources == {"k8s"}
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello from a pod"}], max_tokens=4
            )
            assert reply.choices[0].message.content
            assert (await served_by(a), await served_by(b)) == (1, 0)
            # its series are named by the pod, its URL in the info series (issue 21: stable labels)
            samples = await scrape(app.url)
            assert sample(samples, "kvroute_requests_total", model=MODEL, replica="vllm-a", status="200") == 1
            assert sample(samples, "kvroute_replica_info", replica="vllm-a", url=a.url, model=MODEL) == 1

            kube_api.set_ready("vllm-b", True)
            kube_api.delete("vllm-a")
            await until(lambda: [r.name for r in app.fleet.eligible(MODEL)] == [b.url])
            assert app.fleet.get(a.url) is None
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "and from another"}], max_tokens=4
            )
            assert (await served_by(a), await served_by(b)) == (1, 1)
    finally:
        for r in reps:
            await r.stop()
