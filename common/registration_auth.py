"""Signed replica registrations (docs/design.md §7.7): whoever can write to Redis must not be able
to add a replica, or point a registered one elsewhere, and so receive prompts and the fleet's
API key.

A launcher holding the shared secret adds two fields to its registration hash: ``expires_at``
(Unix seconds: now + its TTL, refreshed by every heartbeat) and ``signature``, the HMAC-SHA256 of
the canonical text of every other field together with the key prefix and the entry's name (so a
signed hash copied to another name, another prefix or another fleet does not verify).  A router
holding the secret believes an entry only if its signature verifies and it has not expired: a
replayed old registration stops being believed ``CLOCK_SKEW_S`` after its ``expires_at``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

SIGNATURE_FIELD = "signature"
EXPIRES_FIELD = "expires_at"
# how far a router's clock may run ahead of a launcher's before the launcher's fresh
# registration reads as expired (hosts kept by NTP are within milliseconds)
CLOCK_SKEW_S = 10.0

Rejection = Literal["unsigned", "bad_signature", "stale"]
REJECTIONS: tuple[Rejection, ...] = ("unsigned", "bad_signature", "stale")


def read_secret(value: str | None, path: str | Path | None) -> bytes | None:
    """The secret given inline or in a file (Kubernetes mounts Secrets as files; a trailing newline
    is not part of it).  Both, or an empty one, is an error: a typo must not turn signing off."""
    if value and path:
        raise ValueError("give the registration secret once: inline or as a file, not both")
    if path:
        try:
            value = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"registration secret file {path}: {exc.strerror or exc}") from None
        value = value.strip()
        if not value:
            raise ValueError(f"registration secret file {path} is empty")
    return value.encode() if value else None


def _canonical(prefix: str, name: str, fields: Mapping[str, str]) -> bytes:
    signed = {k: v for k, v in fields.items() if k != SIGNATURE_FIELD}
    return json.dumps({"prefix": prefix, "name": name, "fields": signed}, sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: bytes, prefix: str, name: str, fields: Mapping[str, str]) -> str:
    return hmac.new(secret, _canonical(prefix, name, fields), hashlib.sha256).hexdigest()


def sign(fields: Mapping[str, str], prefix: str, name: str, secret: bytes, expires_at: float) -> dict[str, str]:
    """``fields`` (a registration hash) with ``expires_at`` and the signature over both added."""
    out = {k: v for k, v in fields.items() if k not in (SIGNATURE_FIELD, EXPIRES_FIELD)}
    out[EXPIRES_FIELD] = repr(float(expires_at))
    out[SIGNATURE_FIELD] = _mac(secret, prefix, name, out)
    return out


def verify(fields: Mapping[str, str], prefix: str, name: str, secret: bytes, now: float) -> Rejection | None:
    """None if the entry ``name`` (its hash ``fields``) was signed with ``secret`` and has not
    expired; else why it is not believed."""
    signature = fields.get(SIGNATURE_FIELD)
    if not signature:
        return "unsigned"
    if not hmac.compare_digest(signature, _mac(secret, prefix, name, fields)):
        return "bad_signature"
    try:
        expires_at = float(fields.get(EXPIRES_FIELD, "nan"))
    except ValueError:
        return "stale"  # signed, yet no readable expiry: only a launcher bug writes that
    if not math.isfinite(expires_at) or now > expires_at + CLOCK_SKEW_S:
        return "stale"
    return None
