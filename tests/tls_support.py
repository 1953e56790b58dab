"""Certificates made for a test by the ``openssl`` command: a private CA, a server certificate for
127.0.0.1/localhost, one for a name only (a fleet's) and a client certificate, all signed by it, and a second CA that signed
neither (to show what a client that trusts the wrong CA gets)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

FLEET_NAME = "replicas.kvroute.test"  # the one name of the "fleet" certificate (not its address)
_EXTENSIONS = {
    "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    "fleet": f"subjectAltName=DNS:{FLEET_NAME}\nextendedKeyUsage=serverAuth\n",
    "client": "extendedKeyUsage=clientAuth\n",
}
_KEY_ID = "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\nbasicConstraints=critical,CA:FALSE\n"


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    fleet_cert: Path  # names FLEET_NAME only, as one certificate for replicas found by IP would
    fleet_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=kvroute test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=cwd)


def _signed(name: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(_EXTENSIONS[name] + _KEY_ID)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvroute test {name}", cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


def make_pki(directory: Path) -> Pki:
    _ca("ca", directory)
    _ca("other-ca", directory)
    for name in ("server", "client", "fleet"):
        _signed(name, directory)
    d = directory
    return Pki(d / "ca.crt", d / "other-ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
               d / "fleet.crt", d / "fleet.key")
