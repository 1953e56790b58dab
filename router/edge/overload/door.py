"""The door: while the router is short of CPU (shares.py), a request whose tenant is over its share
is answered 429 from the connection's raw bytes, before aiohttp builds a request of them.

Refusing through the handler costs about half of serving a one-line chat (the request object, the
middlewares, the access log: docs/experiments.md, 2026-12-05), so a router at twice its capacity
that refused its excess that way would have no CPU left to serve; here a refusal is a split of the
head, a dictionary lookup and one write.  The door looks only at a generation request (POST to a
``/v1/`` completions, chat or responses path) whose head is whole in the bytes at hand and that
starts at a request boundary with nothing before it unanswered (server.py checks that): anything
else goes the usual way.  A request that waited longer than the queue's budget in the kernel
(``late_s``: a router that fell behind, the accept queue of a burst) is refused here too, whoever
sent it: it has had its wait, and serving it would be late.  Its tenant is the one the admission queue uses (tenants.py): the API key,
else the body's ``user`` when the body is whole too, else the client's address.  A request whose
body is whole is consumed and the connection stays open; one whose body is still arriving is
answered with ``Connection: close`` and a lingering close (server.py), since its bytes cannot be
told from the next request's.  The key is not checked here: an unknown key refused at the door
gets a 429 where the handler would have answered 401, and is a tenant like another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvroute.common.errors import error_body
from kvroute.router.edge.forwarded import ClientAddress
from kvroute.router.edge.overload.shares import TenantShares
from kvroute.router.edge.overload.tenants import NO_FIELDS, PRIORITY_HEADER, Priority, body_fields, tenant_of

GENERATION_PATHS = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"))
MAX_HEAD = 16384  # a head longer than this goes the usual way (aiohttp's own limits answer it)
_KEYS_CACHED = 4096  # API key -> tenant label, so that a refusal hashes no key
_PRIORITY = PRIORITY_HEADER.lower().encode()


@dataclass(frozen=True, slots=True)
class Refusal:
    """``answer`` to write; ``consumed`` bytes of the data were the refused request (0: its body is
    still arriving, close the connection after the answer)."""

    answer: bytes
    consumed: int


class Door:
    def __init__(
        self,
        shares: TenantShares,
        client_address: ClientAddress,
        retry_after_s: int,
        on_refused: Callable[[str, Priority], None],
        saw_wait: Callable[[float], None] = lambda waited_s: None,
        late_s: float = 0.0,
    ):
        self.shares = shares
        self.client_address = client_address
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused
        self.saw_wait = saw_wait  # how long a request the door judged waited in the kernel (saturation.py)
        self.late_s = late_s  # a request that waited longer in the kernel is refused, whoever sent it (0: never)
        self._labels: dict[bytes, str] = {}

    def judge(self, data: bytes, peer: str | None, waited_s: float = 0.0) -> Refusal | None:
        """The refusal of the request at the start of ``data``, or None to let it in (or not judge
        it); ``waited_s``: how long its bytes waited in the kernel (saturation.kernel_wait_s)."""
        if not data.startswith(b"POST /v1/"):
            return None
        end = data.find(b"\r\n\r\n", 0, MAX_HEAD)
        if end < 0:
            return None
        lines = data[:end].split(b"\r\n")
        target = lines[0].split(b" ")
        if len(target) != 3 or target[1].partition(b"?")[0] not in GENERATION_PATHS:
            return None
        key = forwarded = priority = None
        length: int | None = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                key = token.strip() if scheme.lower() == b"bearer" else None
            elif name == b"content-length":
                length = int(value) if value.strip().isdigit() else None
            elif name == b"transfer-encoding":
                length = None  # chunked: where the body ends is the parser's to find
            elif name == b"x-forwarded-for":
                forwarded = (forwarded or []) + [value.decode("latin-1")]
            elif name == _PRIORITY:
                priority = value.strip().lower()
        body_at = end + 4
        whole = length is not None and len(data) >= body_at + length
        tenant = self._tenant(key, data[body_at:body_at + length] if whole and length else b"", peer, forwarded)
        self.saw_wait(waited_s)
        allowed = self.shares.allow(tenant, time.monotonic())  # counted, late or not: what it sends
        if 0 < self.late_s < waited_s:
            self.on_refused("stale", _priority(priority))
            message = (f"the router is short of CPU: this request waited {waited_s:.2f} s to be read, past the "
                       f"router's queue budget ({self.late_s:g} s); retry shortly")
        elif allowed:
            return None
        else:
            self.on_refused("over_share", _priority(priority))
            share = self.shares.share_of(tenant) or 0.0
            message = (f"the router is short of CPU and this client ({tenant}) sends more than its fair share of it "
                       f"(about {share:.0f} requests a second now); retry shortly")
        return Refusal(self._answer(message, close=not whole), body_at + length if whole and length is not None else 0)

    def _tenant(self, key: bytes | None, body: bytes, peer: str | None, forwarded: list[str] | None) -> str:
        if key:
            label = self._labels.get(key)
            if label is None:
                if len(self._labels) >= _KEYS_CACHED:
                    self._labels.clear()
                label = self._labels[key] = tenant_of(key.decode("latin-1"), NO_FIELDS, None)
            return label
        fields = body_fields(body) if body else NO_FIELDS
        return tenant_of(None, fields, self.client_address.resolve(peer, forwarded or []))

    def _answer(self, message: str, *, close: bool) -> bytes:
        body = msgspec.json.encode(error_body(message, 429, code="router_overloaded"))
        return (
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Retry-After: %d\r\n%s\r\n" % (len(body), self.retry_after_s, b"Connection: close\r\n" if close else b"")
        ) + body


def _priority(value: bytes | None) -> Priority:
    if value is None:
        return Priority.NORMAL
    try:
        return Priority[value.decode("latin-1").upper()]
    except KeyError:
        return Priority.NORMAL
