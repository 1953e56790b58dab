"""Replicas behind a DNS name (``host:port``): each A/AAAA record is one (a Kubernetes headless
service lists its ready pods this way)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing

log = logging.getLogger("kvroute.router.fleet")


def select_addresses(infos: list[tuple[Any, ...]], family: str = "auto") -> list[str]:
    """Distinct addresses of a getaddrinfo answer, of the family asked for.

    "auto" takes the IPv4 addresses when there are any, else the IPv6 ones: a dual-stack host
    answers with one of each, and must count as one replica, not two.
    """
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    if family == "ipv4" or (family == "auto" and v4):
        return v4
    if family in ("ipv6", "auto"):
        return v6
    return v4 + v6


def address_url(scheme: str, address: str, port: int) -> str:
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


class DnsSource(DiscoverySource):
    name = "dns"

    def __init__(self, dns_name: str, *, scheme: str = "http", family: str = "auto", timeout_s: float = 2.0):
        self.dns_name = dns_name
        self._scheme = scheme
        self._family = family
        self._timeout_s = timeout_s
        self._seen: set[str] = set()  # last successful answer

    async def list(self) -> Listing:
        try:
            async with asyncio.timeout(self._timeout_s):
                self._seen = await self._resolve()
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("DNS discovery of %s failed, keeping %d addresses: %s", self.dns_name, len(self._seen), exc)
        return dict.fromkeys(self._seen)

    async def _resolve(self) -> set[str]:
        host, _, port_text = self.dns_name.rpartition(":")
        if not host or not port_text.isdigit():
            raise ValueError(f"dns_name must be host:port, got {self.dns_name!r}")
        infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port_text), type=socket.SOCK_STREAM)
        return {address_url(self._scheme, a, int(port_text)) for a in select_addresses(infos, self._family)}
