"""Who a queued request belongs to (its tenant) and how urgent it is (its priority class).

Tenant: the API key (as ``key-`` and the first 10 hex digits of its sha256, never the key), else
the body's ``user`` field (``user:NAME``), else the client's address (``addr:IP``, from
forwarded.py: X-Forwarded-For only behind a trusted proxy).  ``tenant_weights`` names tenants
this way.  Priority: the ``X-Kvroute-Priority`` header (high, normal, low; any other value is a
400), else OpenAI's ``service_tier`` ("priority" high, "flex" low, anything else normal).  The
tenant is read for every request while the queue is on (who holds which slots: reserve.py), the
class for one that has to queue: the body's two fields with msgspec, which builds nothing else
(design.md §7.6).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvroute.common.errors import ApiError
from kvroute.router.request.route import client_label

PRIORITY_HEADER = "X-Kvroute-Priority"


class Priority(enum.IntEnum):
    """Served in this order; shed in the reverse."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        return self.name.lower()


_BY_NAME = {p.label: p for p in Priority}
_BY_SERVICE_TIER = {"priority": Priority.HIGH, "flex": Priority.LOW}


def header_priority(value: str | None) -> Priority | None:
    """The header's class, None without one; a 400 for a value that is not a class."""
    if value is None:
        return None
    found = _BY_NAME.get(value.strip().lower())
    if found is None:
        raise ApiError(400, f"invalid {PRIORITY_HEADER} header {value[:32]!r}: use high, normal or low",
                       param=PRIORITY_HEADER, code="invalid_priority")
    return found


class _Fields(msgspec.Struct):
    """The two body fields a queued request is sorted by (msgspec skips every other one)."""

    user: Any = None
    service_tier: Any = None


NO_FIELDS = _Fields()


def body_fields(raw: bytes) -> _Fields:
    try:
        return msgspec.json.decode(raw, type=_Fields)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # nested past msgspec's depth
        return _Fields()  # not a JSON object: the request's own parse answers the 400 once admitted


def priority_of(header: Priority | None, fields: _Fields) -> Priority:
    if header is not None:
        return header
    tier = fields.service_tier
    return _BY_SERVICE_TIER.get(tier, Priority.NORMAL) if isinstance(tier, str) else Priority.NORMAL


def tenant_of(api_key: str | None, fields: _Fields, client_address: str | None) -> str:
    if api_key:
        return client_label(None, api_key)
    if isinstance(fields.user, str) and fields.user:
        return "user:" + fields.user[:64]
    return f"addr:{client_address or 'unknown'}"
