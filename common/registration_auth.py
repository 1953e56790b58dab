"""Signed replica registrations (docs/design.md §7.7): whoever can write to Redis must not be able
to add a replica, or point a registered one elsewhere, and so receive prompts and the fleet's
API key.

A launcher holding the shared secret adds two fields to its registration hash: ``expires_at``
(Unix seconds: now + its TTL, refreshed by every heartbeat) and ``signature``, the HMAC-SHA256 of
the canonical text of every other field together with the key prefix and the entry's name (so a
signed hash copied to another name, another prefix or another fleet does not verify).  A router
holding the secret believes an entry only if its signature verifies and it has not expired: a
replayed old registration stops being believed ``CLOCK_SKEW_S`` after its ``expires_at``.

Rotation without a gap: the secret's text may hold several secrets, one per line.  A launcher
signs with the first; a router believes an entry signed with any of them.  So the fleet moves from
OLD to NEW in three rollouts, each safe in any order of restarts: "OLD, NEW" (routers learn NEW,
launchers still sign with OLD), "NEW, OLD" (launchers sign with NEW, which every router already
believes), "NEW" (OLD no longer believed) (docs/deploy.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

SIGNATURE_FIELD = "signature"
EXPIRES_FIELD = "expires_at"
# how far a router's clock may run ahead of a launcher's before the launcher's fresh
# registration reads as expired (hosts kept by NTP are within milliseconds)
CLOCK_SKEW_S = 10.0

Rejection = Literal["unsigned", "bad_signature", "stale"]
REJECTIONS: tuple[Rejection, ...] = ("unsigned", "bad_signature", "stale")


def read_secrets(value: str | None, path: str | Path | None) -> tuple[bytes, ...]:
    """The secrets given inline or in a file (Kubernetes mounts Secrets as files), one per line:
    the first signs, any verifies (rotation, above); blank lines and the space around a secret
    (a trailing newline) are not part of any.  Empty: none given.  Both, or a file with no secret,
    is an error: a typo must not turn signing off."""
    if value and path:
        raise ValueError("give the registration secret once: inline or as a file, not both")
    if path:
        try:
            value = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"registration secret file {path}: {exc.strerror or exc}") from None
        if not value.strip():
            raise ValueError(f"registration secret file {path} is empty")
    return tuple(line.strip().encode() for line in (value or "").splitlines() if line.strip())


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


def verify(
    fields: Mapping[str, str], prefix: str, name: str, secrets: bytes | Sequence[bytes], now: float
) -> Rejection | None:
    """None if the entry ``name`` (its hash ``fields``) was signed with ``secrets`` (one, or any of
    several: the current and the previous during a rotation) and has not expired; else why it is
    not believed."""
    signature = fields.get(SIGNATURE_FIELD)
    if not signature:
        return "unsigned"
    keys = (secrets,) if isinstance(secrets, bytes) else secrets
    if not any(hmac.compare_digest(signature, _mac(key, prefix, name, fields)) for key in keys):
        return "bad_signature"
    try:
        expires_at = float(fields.get(EXPIRES_FIELD, "nan"))
    except ValueError:
        return "stale"  # signed, yet no readable expiry: only a launcher bug writes that
    if not math.isfinite(expires_at) or now > expires_at + CLOCK_SKEW_S:
        return "stale"
    return None
