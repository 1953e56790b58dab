"""TLS contexts from PEM files: a server's (the router's listener, the emulated replica's) and a
client's (the router to https replicas, with a CA bundle and, for mTLS, its own certificate).

Each is built once, at start, so a missing file, a file that is not PEM, or a key that does not
match its certificate stops the process with a message naming the setting and the file (the
``ssl`` module's own errors name neither), instead of failing every handshake later.
"""

from __future__ import annotations

import ssl
from pathlib import Path


class TlsFileError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the setting and file."""


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path | None, names: tuple[str, str]) -> None:
    for path, name in ((cert, names[0]), (key, names[1])):
        if path is not None and not Path(path).is_file():
            raise TlsFileError(f"{name} {path}: no such file")
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsFileError(f"{names[0]} {cert} / {names[1]} {key}: not a PEM certificate and its matching "
                           f"private key ({exc})") from exc


def _load_ca(ctx: ssl.SSLContext, ca: Path, name: str) -> None:
    if not Path(ca).is_file():
        raise TlsFileError(f"{name} {ca}: no such file")
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise TlsFileError(f"{name} {ca}: not a PEM CA bundle ({exc})") from exc


def server_context(
    cert: Path, key: Path, *, client_ca: Path | None = None, require_client_cert: bool = False,
    names: tuple[str, str, str] = ("--tls-cert-file", "--tls-key-file", "--tls-ca-file"),
) -> ssl.SSLContext:
    """A listener's context (TLS 1.2 or later): its certificate chain and key; with ``client_ca``,
    client certificates signed by it are verified (required if ``require_client_cert``)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(ctx, cert, key, names[:2])
    if client_ca is not None:
        _load_ca(ctx, client_ca, names[2])
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None,
    names: tuple[str, str, str] = ("--fleet.replica-ca-file", "--fleet.replica-client-cert-file",
                                   "--fleet.replica-client-key-file"),
) -> ssl.SSLContext:
    """A client's context: the server's certificate and host name verified against ``ca`` (else the
    system's CAs); ``cert`` and ``key`` its own certificate for servers that require one (mTLS)."""
    ctx = ssl.create_default_context()
    if ca is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # only this bundle: a private CA, not the world's
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_ca(ctx, ca, names[0])
    if cert is not None:
        _load_chain(ctx, cert, key, names[1:])
    elif key is not None:
        raise TlsFileError(f"{names[2]} {key} without {names[1]}")
    return ctx
