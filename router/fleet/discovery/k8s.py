"""Replicas from the Kubernetes API: the ready pods matching a label selector (``--fleet.k8s-selector``).

Pods, not EndpointSlices (docs/design.md §7.3): the selector names the vLLM pods themselves (as
SGLang's and the vLLM production-stack routers do), so a fleet started by someone else's chart
needs no Service.  A pod is a replica while it is Running, Ready, has an IP and no
deletionTimestamp; its URL is ``http://<podIP>:<port named port_name>`` (``https`` with ``scheme``), else the fallback port.

One background task keeps the listing: a paginated list, then a watch from its resourceVersion
(ADDED/MODIFIED/DELETED, BOOKMARKs).  A watch that times out resumes; a 410 Gone lists again; any
other failure is logged, counted and retried with capped exponential backoff (then a full list),
the last listing kept meanwhile.  The fleet reads the listing every health interval.

kubernetes_asyncio (on aiohttp, like the router) is the optional extra ``k8s``, imported only when
this source is used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing
from kvroute.router.fleet.discovery.dns import address_url
from kvroute.router.fleet.discovery.metrics import DiscoveryMetrics

log = logging.getLogger("kvroute.router.fleet")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LIST_PAGE = 500  # pods per list call (the API server's continue token pages the rest)


class WatchExpired(Exception):
    """410 Gone: the resourceVersion is older than the API server keeps; list again."""


class ProtocolError(Exception):
    """An answer that is not what the Kubernetes API sends."""


def pod_is_ready(pod: dict[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def pod_port(pod: dict[str, Any], port_name: str, fallback: int | None) -> int | None:
    """The containerPort named ``port_name`` in any container, else ``fallback``."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == port_name and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return fallback


async def load_api_config(namespace: str | None) -> tuple[Any, str]:
    """(client Configuration, namespace): ``$KUBECONFIG`` when set, else the pod's service account
    in a cluster, else ``~/.kube/config``.  The namespace, when not given, is the service
    account's or the kubeconfig context's, else "default"."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    path = os.environ.get("KUBECONFIG")
    if not path and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(  # https to $KUBERNETES_SERVICE_HOST; re-reads the rotated token itself
            client_configuration=cfg,
            token_filename=str(SERVICE_ACCOUNT_DIR / "token"),
            cert_filename=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        )
        ns_file = SERVICE_ACCOUNT_DIR / "namespace"
        return cfg, namespace or (ns_file.read_text().strip() if ns_file.is_file() else "default")
    # read here, not at import as kubernetes_asyncio's default does, so a later KUBECONFIG counts
    loader = await config.load_kube_config(
        config_file=path or os.path.expanduser("~/.kube/config"), client_configuration=cfg, persist_config=False
    )
    context = (loader.current_context or {}).get("context") or {}
    return cfg, namespace or context.get("namespace") or "default"


class K8sSource(DiscoverySource):
    name = "k8s"

    def __init__(
        self,
        selector: str,
        *,
        namespace: str | None = None,
        port_name: str = "http",
        port: int | None = None,
        scheme: str = "http",
        timeout_s: float = 2.0,
        watch_timeout_s: float = 300.0,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        metrics: DiscoveryMetrics | None = None,
    ):
        try:
            import kubernetes_asyncio  # noqa: F401 - a missing extra is a start-up error, not a retry loop
        except ImportError as exc:
            raise RuntimeError("fleet.k8s_selector needs kubernetes_asyncio: pip install 'kvroute[k8s]'") from exc
        self.selector = selector
        self.namespace = namespace  # resolved from the config when None
        self._port_name = port_name
        self._port = port
        self._scheme = scheme
        self._timeout_s = timeout_s
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self.metrics = metrics if metrics is not None else DiscoveryMetrics()
        for error in ("config", "connection", "api", "protocol"):  # at zero from the first scrape
            self.metrics.errors.labels("k8s", error)
        self._pods: dict[str, str] = {}  # pod name -> replica URL, ready pods only
        self._names: dict[str, str] = {}  # replica URL -> pod name, of the last listing
        self._no_port_warned: set[str] = set()
        self._synced = asyncio.Event()  # the first list has landed
        self._task: asyncio.Task[None] | None = None
        self._api: Any = None  # kubernetes_asyncio ApiClient

    async def list(self) -> Listing:
        if self._task is None:
            self._task = asyncio.create_task(self._run())
            try:  # the first call waits (boundedly) for the first list, so a router starts with its pods
                async with asyncio.timeout(self._timeout_s):
                    await self._synced.wait()
            except TimeoutError:
                log.warning("Kubernetes discovery (%s) has no listing yet: pods join when it has", self.selector)
        self._names = {url: pod for pod, url in self._pods.items()}  # as listed: label() reads it
        return dict.fromkeys(self._names)

    def label(self, url: str) -> str | None:
        """The pod's name: stable across a restart in place (a StatefulSet's), where its IP is not."""
        return self._names.get(url)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._api is not None:
            await self._api.close()
            self._api = None

    # -- the list+watch loop --------------------------------------------------------------
    async def _run(self) -> None:
        delay = self._backoff_s[0]
        reason = "start"
        listed_at = -float("inf")
        while True:
            try:
                core = await self._core_api()
                # lists at least backoff_s[0] apart, should an API server answer every watch with 410
                await asyncio.sleep(max(0.0, listed_at + self._backoff_s[0] - time.monotonic()))
                listed_at = time.monotonic()
                version = await self._relist(core, reason)
                delay = self._backoff_s[0]
                while True:  # a watch ends at its timeout: resume from where it got to
                    version = await self._watch(core, version)
            except asyncio.CancelledError:
                raise
            except WatchExpired as exc:
                log.info("Kubernetes watch of %s expired (%s): listing again", self.selector, exc)
                reason = "expired"
            except Exception as exc:  # noqa: BLE001 - never let discovery die: log, count, back off
                kind = self._error_kind(exc)
                self.metrics.errors.labels("k8s", kind).inc()
                log.warning(
                    "Kubernetes discovery of %s failed (%s: %s); keeping %d pods, retrying in %.1f s",
                    self.selector, kind, str(exc)[:300], len(self._pods), delay,
                )
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self._backoff_s[1])
                reason = "error"

    @staticmethod
    def _error_kind(exc: Exception) -> str:
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.config import ConfigException

        if isinstance(exc, ConfigException | FileNotFoundError):
            return "config"
        if isinstance(exc, ApiException) and exc.status:
            return "api"
        if isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
            return "connection"
        return "protocol"

    async def _core_api(self) -> Any:
        from kubernetes_asyncio import client

        if self._api is None:
            cfg, self.namespace = await load_api_config(self.namespace)
            self._api = client.ApiClient(cfg)
        return client.CoreV1Api(self._api)

    async def _relist(self, core: Any, reason: str) -> str:
        """Replace the listing with a full list; its resourceVersion."""
        self.metrics.relists.labels("k8s", reason).inc()
        pods: dict[str, str] = {}
        token: str | None = None
        timeout = aiohttp.ClientTimeout(sock_connect=self._timeout_s, sock_read=max(self._timeout_s, 30.0))
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.selector, "limit": LIST_PAGE}
            if token:
                kwargs["_continue"] = token
            resp = await core.list_namespaced_pod(
                self.namespace, _preload_content=False, _request_timeout=timeout, **kwargs
            )
            async with resp:
                body = await resp.read()
                status = resp.status
            page = self._page(status, body)
            for pod in page.get("items") or ():
                self._apply(pods, pod)
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        version = meta.get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise ProtocolError("pod list without metadata.resourceVersion")
        self._pods = pods
        self._synced.set()
        return version

    @staticmethod
    def _page(status: int, body: bytes) -> dict[str, Any]:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            page = json.loads(body)
        except ValueError as exc:
            raise ProtocolError(f"HTTP {status}, not JSON: {body[:200]!r}") from exc
        if status == 410 or (isinstance(page, dict) and page.get("code") == 410):
            raise WatchExpired(page.get("message", "410 Gone"))  # a continue token past compaction
        if not 200 <= status < 300:
            raise ApiException(status=status, reason=page.get("message") if isinstance(page, dict) else None)
        if not isinstance(page, dict):
            raise ProtocolError("pod list is not an object")
        return page

    async def _watch(self, core: Any, version: str) -> str:
        """Apply one watch's events from ``version``; the version it reached when it ended."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        # client-go's spread of watch lengths, so many routers do not reconnect in step
        seconds = int(self._watch_timeout_s * random.uniform(1.0, 2.0)) or 1
        timeout = aiohttp.ClientTimeout(sock_connect=self._timeout_s, sock_read=seconds + 30)
        w = watch.Watch(return_type="object")  # plain dicts, no model classes
        stream = w.stream(
            core.list_namespaced_pod,
            self.namespace,
            label_selector=self.selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=seconds,
            _request_timeout=timeout,
        )
        try:
            async with stream:
                async for event in stream:
                    if not isinstance(event, dict):
                        raise ProtocolError(f"watch line is not an event: {str(event)[:200]!r}")
                    self._on_event(event)
        except ApiException as exc:
            if exc.status == 410:
                raise WatchExpired(exc.reason) from exc
            raise
        return w.resource_version or version

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        pod = event.get("raw_object")
        self.metrics.events.labels("k8s", str(kind)).inc()
        if kind == "BOOKMARK" or not isinstance(pod, dict):
            return  # the watch took its resourceVersion
        if kind == "DELETED":
            self._pods.pop((pod.get("metadata") or {}).get("name", ""), None)
        elif kind in ("ADDED", "MODIFIED"):
            self._apply(self._pods, pod)

    def _apply(self, pods: dict[str, str], pod: dict[str, Any]) -> None:
        """Record a pod's current state in ``pods``: its URL if it is a ready replica, else nothing."""
        name = (pod.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            return
        pods.pop(name, None)
        if not pod_is_ready(pod):
            return
        port = pod_port(pod, self._port_name, self._port)
        if port is None:
            if name not in self._no_port_warned:
                self._no_port_warned.add(name)
                log.warning("pod %s has no container port named %r and no fallback port: skipped", name, self._port_name)
            return
        pods[name] = address_url(self._scheme, pod["status"]["podIP"], port)
