"""What the fleet asks each replica over HTTP: ``/health``, ``/v1/models``, ``/metrics``.

Each call has its own timeout and answers plainly (a verdict, the model cards, the scraped
load) or None; what the answers mean for the replica's state is the fleet's business.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Literal, NamedTuple

import aiohttp

from kvroute.common.scrape import ScrapeResult, parse_vllm_metrics

log = logging.getLogger("kvroute.router.fleet")

Health = Literal["ok", "failed", "refused"]
AUTH_STATUSES = frozenset({401, 403})


class AuthRefused(NamedTuple):
    """A replica answered 401/403: it refuses the router's API key (``fleet.replica_api_key``)."""

    status: int
    path: str


class TlsFailed(NamedTuple):
    """An https replica the router cannot talk TLS with: why, and what to check."""

    reason: str


def _tls_failure(url: str, exc: Exception, has_client_cert: bool) -> TlsFailed | None:
    """A TLS failure to report, or None.  A handshake that fails says why (an untrusted certificate,
    a host name it does not name).  A replica that requires a client certificate the router did not
    present cannot say so in TLS 1.3: the handshake completes on the router's side and the replica
    just closes the connection, which is all the router sees."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return TlsFailed(f"TLS handshake failed: {exc.os_error} (check fleet.replica_ca_file)")
    if isinstance(exc, aiohttp.ServerDisconnectedError) and url.startswith("https:") and not has_client_cert:
        return TlsFailed("it closes TLS connections without answering, as a replica that requires a client "
                         "certificate does (set fleet.replica_client_cert_file and fleet.replica_client_key_file)")
    return None


class ReplicaProbes:
    def __init__(
        self, session: aiohttp.ClientSession, headers: dict[str, str], *, health_timeout_s: float, metrics_timeout_s: float,
        has_client_cert: bool = False, server_name: str | None = None,
    ):
        self.session = session
        self.headers = headers  # the replicas' API key, if any
        self.has_client_cert = has_client_cert  # the session presents one to https replicas (mTLS)
        # what https replicas' certificates name, when not the host of their URLs (the pool's rule too)
        self._tls_name = {"server_hostname": server_name} if server_name else {}
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._metrics_timeout = aiohttp.ClientTimeout(total=metrics_timeout_s)

    def _get(self, url: str, timeout: aiohttp.ClientTimeout) -> Any:
        return self.session.get(url, headers=self.headers, timeout=timeout, **self._tls_name)

    async def health(self, url: str) -> Health | TlsFailed:
        """"refused": nothing listens there (conclusive); "failed": a timeout or an error status;
        :class:`TlsFailed`: TLS with it fails (the fleet reports it, and counts it as "failed")."""
        try:
            async with self._get(url + "/health", self._health_timeout) as resp:
                await resp.read()
                return "ok" if resp.status == 200 else "failed"
        except aiohttp.ClientConnectorError as exc:
            tls = _tls_failure(url, exc, self.has_client_cert)
            if tls is not None:
                return tls
            return "refused" if exc.os_error.errno == errno.ECONNREFUSED else "failed"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _tls_failure(url, exc, self.has_client_cert) or "failed"

    async def model_cards(self, url: str) -> list[dict[str, Any]] | AuthRefused | None:
        """The cards of ``/v1/models`` (those with a string id), :class:`AuthRefused` for a 401/403
        (the fleet logs it), or None (logged)."""
        try:
            async with self._get(url + "/v1/models", self._health_timeout) as resp:
                if resp.status in AUTH_STATUSES:
                    return AuthRefused(resp.status, "/v1/models")
                if resp.status != 200:
                    log.warning("replica %s: /v1/models answered %d", url, resp.status)
                    return None
                body = await resp.json(content_type=None)
            return [c for c in body["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.warning("replica %s: reading /v1/models failed: %r", url, exc)
            return None

    async def metrics(self, url: str) -> ScrapeResult | None:
        """vLLM's ``/metrics``, parsed, or None."""
        try:
            async with self._get(url + "/metrics", self._metrics_timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
            return parse_vllm_metrics(text)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            log.debug("replica %s: scraping /metrics failed: %r", url, exc)
            return None
