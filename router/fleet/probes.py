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


class ReplicaProbes:
    def __init__(
        self, session: aiohttp.ClientSession, headers: dict[str, str], *, health_timeout_s: float, metrics_timeout_s: float
    ):
        self.session = session
        self.headers = headers  # the replicas' API key, if any
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._metrics_timeout = aiohttp.ClientTimeout(total=metrics_timeout_s)

    async def health(self, url: str) -> Health:
        """"refused": nothing listens there (conclusive); "failed": a timeout or an error status."""
        try:
            async with self.session.get(url + "/health", headers=self.headers, timeout=self._health_timeout) as resp:
                await resp.read()
                return "ok" if resp.status == 200 else "failed"
        except aiohttp.ClientConnectorError as exc:
            return "refused" if exc.os_error.errno == errno.ECONNREFUSED else "failed"
        except (aiohttp.ClientError, OSError, TimeoutError):
            return "failed"

    async def model_cards(self, url: str) -> list[dict[str, Any]] | AuthRefused | None:
        """The cards of ``/v1/models`` (those with a string id), :class:`AuthRefused` for a 401/403
        (the fleet logs it), or None (logged)."""
        try:
            async with self.session.get(url + "/v1/models", headers=self.headers, timeout=self._health_timeout) as resp:
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
            async with self.session.get(url + "/metrics", headers=self.headers, timeout=self._metrics_timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
            return parse_vllm_metrics(text)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            log.debug("replica %s: scraping /metrics failed: %r", url, exc)
            return None
