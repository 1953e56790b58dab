"""The client's address: the peer's, or behind trusted proxies the one they name in ``X-Forwarded-For``.

A client can write any ``X-Forwarded-For`` it likes, so the header is read only when the direct
peer is a trusted proxy (``trusted_proxies``, CIDRs), and then from the right: each proxy appends
the address it got the request from, so the rightmost address that is not itself a trusted proxy is
the client (nginx's ``real_ip_recursive``).  Entries further left were written by the client and are
ignored; an entry that is not an address ends the walk at the last trusted hop.  The tenant of fair
queueing (overload/tenants.py) and the access log's ``client`` both come from here (design.md §7.6).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from aiohttp import web

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ClientAddress:
    """``of(request)``: the client's address as the trusted proxies in front of the router saw it."""

    def __init__(self, trusted_proxies: Iterable[Network] = ()):
        self.trusted: Sequence[Network] = tuple(trusted_proxies)

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)

    def of(self, request: web.Request) -> str | None:
        return self.resolve(request.remote, request.headers.getall("X-Forwarded-For", []))

    def resolve(self, peer: str | None, forwarded_for: Sequence[str]) -> str | None:
        """The client, from the peer's address and the request's ``X-Forwarded-For`` headers in order."""
        if not self.trusted or peer is None or not self._is_trusted(peer):
            return peer
        client = peer
        for header in reversed(forwarded_for):
            for hop in reversed(header.split(",")):
                hop = hop.strip()
                try:
                    ipaddress.ip_address(hop)
                except ValueError:
                    return client  # garbage in the chain: the last hop a trusted proxy vouched for
                client = hop
                if not self._is_trusted(hop):
                    return client
        return client
