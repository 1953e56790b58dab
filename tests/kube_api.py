"""The pod list+watch endpoints of the Kubernetes API, served by a real aiohttp server on loopback.

No kube-apiserver can run here (none on PyPI or in Debian 12, whose Go 1.19 cannot build one), so
the tests speak to this: the same HTTP protocol (``GET /api/v1/namespaces/NS/pods`` with
labelSelector, limit/continue pages, ``watch=true`` from a resourceVersion as JSON lines of ADDED,
MODIFIED, DELETED, BOOKMARK and ERROR events, ``timeoutSeconds``, 410 Gone for a compacted
version, Status objects for errors, bearer-token auth), over objects shaped as the API server
returns them (tests/assets/k8s/vllm-pod.json: a vLLM pod in the shape ``kubectl get pod -o json``
prints, written for these tests rather than captured from a cluster).

Like etcd, every change takes the next resourceVersion and is kept in a history a watch replays
from; ``compact()`` drops that history, as the API server's compaction does.  A test drives the
changes (create, set_ready, delete), the failures (stop/start, fail_status, stall_watches,
end_watches) and reads ``requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.conftest import free_port

POD_JSON = Path(__file__).resolve().parent / "assets" / "k8s" / "vllm-pod.json"
NAMESPACE = "llm"


def self_signed_tls(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A server context for 127.0.0.1 and its certificate (which is its own CA), made by openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=kube-apiserver", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context, cert


def make_pod(
    name: str,
    ip: str,
    port: int,
    *,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    port_name: str = "http",
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    """The vLLM pod of POD_JSON renamed, at ``ip``, serving on container port ``port_name``=``port``."""
    pod = json.loads(POD_JSON.read_text())
    meta = pod["metadata"]
    meta.update(name=name, namespace=namespace, uid=f"uid-{name}")
    if labels is not None:
        meta["labels"] = labels
    pod["spec"]["containers"][0]["ports"][0].update(name=port_name, containerPort=port)
    pod["status"].update(podIP=ip, podIPs=[{"ip": ip}])
    set_readiness(pod, ready)
    return pod


def set_readiness(pod: dict[str, Any], ready: bool) -> None:
    """As the kubelet reports a readiness probe passing or failing: Running either way."""
    value = "True" if ready else "False"
    for cond in pod["status"]["conditions"]:
        if cond["type"] in ("Ready", "ContainersReady"):
            cond["status"] = value
    for cs in pod["status"]["containerStatuses"]:
        cs["ready"] = ready


def go_bool(text: str | None) -> bool:
    """A query flag as the API server parses it (Go's strconv.ParseBool)."""
    return text in ("1", "t", "T", "true", "TRUE", "True")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass(eq=False)
class _Watcher:
    namespace: str
    selector: str
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    stalled: bool = False


class KubeApiServer:
    def __init__(self, token: str = "kvroute-test-token", tls: ssl.SSLContext | None = None):
        self.token = token
        self.tls = tls  # serve https (as the API server always does in a cluster)
        self.port = free_port()  # kept across stop/start: the kubeconfig names it
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 1000  # the last resourceVersion given out
        self.compacted_at = self.version  # a watch from an older version gets 410 Gone
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object) after compacted_at
        self.bookmark_interval_s: float | None = None  # BOOKMARK events on watches that asked for them
        self.fail_status: int | None = None  # answer every request with this error status
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list" | "watch", query)
        self.bookmarks: list[int] = []  # the version of each BOOKMARK sent, in order
        self._snapshots: dict[int, list[dict[str, Any]]] = {}  # paged lists, by their version
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> KubeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls).start()
        return self

    async def stop(self) -> None:
        """The API server goes away: open watches end, new connections are refused."""
        await self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def write_kubeconfig(self, path: Path, *, namespace: str | None = NAMESPACE, token: str | None = None) -> Path:
        context: dict[str, Any] = {"cluster": "test", "user": "router"}
        if namespace:
            context["namespace"] = namespace
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "router", "user": {"token": token or self.token}}],
            "contexts": [{"name": "test", "context": context}],
            "current-context": "test",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    def write_service_account(self, directory: Path, ca_cert: Path, namespace: str = NAMESPACE) -> Path:
        """What the kubelet mounts into a pod: token, ca.crt and namespace."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(self.token)
        (directory / "ca.crt").write_bytes(ca_cert.read_bytes())
        (directory / "namespace").write_text(namespace)
        return directory

    # -- changes, as controllers and kubelets make them ------------------------------------
    def create(self, pod: dict[str, Any]) -> None:
        self._change("ADDED", copy.deepcopy(pod))

    def set_ready(self, name: str, ready: bool, namespace: str = NAMESPACE) -> None:
        pod = copy.deepcopy(self.pods[(namespace, name)])
        set_readiness(pod, ready)
        self._change("MODIFIED", pod)

    def terminate(self, name: str, namespace: str = NAMESPACE) -> None:
        """A graceful delete's first step: deletionTimestamp set, the pod still Running and Ready."""
        pod = copy.deepcopy(self.pods[(namespace, name)])
        pod["metadata"]["deletionTimestamp"] = "2026-12-03T12:00:00Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        self._change("MODIFIED", pod)

    def delete(self, name: str, namespace: str = NAMESPACE) -> None:
        self._change("DELETED", copy.deepcopy(self.pods[(namespace, name)]))

    def _change(self, kind: str, pod: dict[str, Any]) -> None:
        self.version += 1
        meta = pod["metadata"]
        meta["resourceVersion"] = str(self.version)
        key = (meta["namespace"], meta["name"])
        if kind == "DELETED":
            self.pods.pop(key)
        else:
            self.pods[key] = pod
        self.history.append((self.version, kind, pod))
        for w in self._watchers:
            if not w.stalled and self._watched(w, pod):
                w.queue.put_nowait(("event", {"type": kind, "object": pod}))

    # -- failures ------------------------------------------------------------------------
    def compact(self) -> None:
        """Drop the history up to now: a watch or a list page from an older version gets 410 Gone."""
        self.compacted_at = self.version
        self.history.clear()
        self._snapshots.clear()

    def stall_watches(self) -> None:
        """Open watches receive nothing more (as a watch whose cache fell behind)."""
        for w in self._watchers:
            w.stalled = True

    async def end_watches(self, *, expired: bool = False) -> None:
        """End the open watches; ``expired``: with the ERROR 410 event the API server sends a
        watcher it cannot bring up to date."""
        for w in list(self._watchers):
            w.queue.put_nowait(("end", expired))
        while self._watchers:
            await asyncio.sleep(0.01)

    # -- HTTP ----------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if self.fail_status is not None:
            return web.json_response(status(self.fail_status, "InternalError", "injected failure"), status=self.fail_status)
        query = dict(request.query)
        watch = go_bool(query.get("watch"))
        self.requests.append(("watch" if watch else "list", query))
        namespace = request.match_info["namespace"]
        if watch:
            return await self._watch(request, namespace, query)
        return self._list(namespace, query)

    def _watched(self, w: _Watcher, pod: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        return meta["namespace"] == w.namespace and selector_matches(w.selector, meta.get("labels") or {})

    def _list(self, namespace: str, query: dict[str, str]) -> web.Response:
        selector = query.get("labelSelector", "")
        token = query.get("continue")
        if token:
            version, offset = (int(x) for x in token.split(":"))
            if version not in self._snapshots:
                return web.json_response(status(410, "Expired", "The provided continue parameter is too old"), status=410)
        else:
            version, offset = self.version, 0
            items = [
                copy.deepcopy(p)
                for (ns, _), p in sorted(self.pods.items())
                if ns == namespace and selector_matches(selector, p["metadata"].get("labels") or {})
            ]
            self._snapshots[version] = items
        items = self._snapshots[version]
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[offset : offset + limit]
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if offset + limit < len(items):
            meta["continue"] = f"{version}:{offset + limit}"
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

    async def _watch(self, request: web.Request, namespace: str, query: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = int(query.get("resourceVersion") or self.version)
        if since < self.compacted_at:
            expired = status(410, "Expired", f"too old resource version: {since} ({self.compacted_at})")
            await resp.write(json.dumps({"type": "ERROR", "object": expired}).encode() + b"\n")
            return resp
        w = _Watcher(namespace, query.get("labelSelector", ""))
        for version, kind, pod in self.history:
            if version > since and self._watched(w, pod):
                w.queue.put_nowait(("event", {"type": kind, "object": pod}))
        self._watchers.add(w)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = go_bool(query.get("allowWatchBookmarks")) and self.bookmark_interval_s
        try:
            while (left := deadline - loop.time()) > 0:
                wait = min(left, bookmarks) if bookmarks else left
                try:
                    what, payload = await asyncio.wait_for(w.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and not w.stalled and loop.time() < deadline:
                        mark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}
                        await resp.write(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                        self.bookmarks.append(self.version)
                    continue
                if what == "end":
                    if payload:
                        expired = status(410, "Expired", "The resourceVersion for the provided watch is too old.")
                        await resp.write(json.dumps({"type": "ERROR", "object": expired}).encode() + b"\n")
                    break
                await resp.write(json.dumps(payload).encode() + b"\n")
        except ConnectionResetError:
            pass  # the client went away
        finally:
            self._watchers.discard(w)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
