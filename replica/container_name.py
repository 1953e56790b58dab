"""The name a container answers to on its Docker network, for `kvroute replica --name-from-dns`.

A replica registered under a stable name keeps its `replica` label in the routers' metrics when it
restarts with another IP (router/fleet/discovery/labels.py).  A compose replica's stable name is
its container's, `kvroute-replica-emulated-3` (project, service, index), but nothing inside the
container says it: the hostname is the container's id, and `/etc/hosts` maps the container's IP to
that id, so the C library's reverse lookup (which reads `/etc/hosts` first) answers the id.
Docker's own DNS server (the `nameserver` of `/etc/resolv.conf`, 127.0.0.11) answers the reverse
lookup of the IP with `<container name>.<network>`: this module asks it directly, one PTR query
over UDP (RFC 1035), and keeps the first label.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
from pathlib import Path

PTR, IN = 12, 1


def nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> str | None:
    """The first ``nameserver`` of resolv.conf (Docker's embedded DNS in a container), or None."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            return fields[1]
    return None


def _query(ip: str) -> tuple[int, bytes]:
    qid = secrets.randbits(16)
    qname = ipaddress.ip_address(ip).reverse_pointer
    labels = b"".join(bytes([len(p)]) + p.encode() for p in qname.split(".")) + b"\0"
    return qid, struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + struct.pack("!HH", PTR, IN)


def _name(message: bytes, offset: int) -> tuple[str, int]:
    """The domain name at ``offset`` (compression pointers followed) and the offset after it."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # a loop of pointers is a malformed answer, not a hang
        length = message[offset]
        if length & 0xC0 == 0xC0:
            end = offset + 2 if end is None else end
            offset = ((length & 0x3F) << 8) | message[offset + 1]
        elif length == 0:
            return ".".join(labels), offset + 1 if end is None else end
        else:
            labels.append(message[offset + 1:offset + 1 + length].decode("ascii", "replace"))
            offset += 1 + length
    raise ValueError("DNS answer: too many labels")


def ptr_name(ip: str, server: str, port: int = 53, timeout: float = 2.0) -> str | None:
    """The name ``server`` gives ``ip`` (a PTR record), or None: no answer, an error, no record."""
    qid, query = _query(ip)
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(query, (server, port))
            answer, _ = sock.recvfrom(4096)
        except OSError:
            return None
    try:
        rid, flags, qdcount, ancount = struct.unpack("!HHHH", answer[:8])
        if rid != qid or flags & 0x000F:  # another query's answer, or an error (NXDOMAIN...)
            return None
        offset = 12
        for _ in range(qdcount):
            _, offset = _name(answer, offset)
            offset += 4
        for _ in range(ancount):
            _, offset = _name(answer, offset)
            rtype, _, _, rdlength = struct.unpack("!HHIH", answer[offset:offset + 10])
            offset += 10
            if rtype == PTR:
                return _name(answer, offset)[0].rstrip(".") or None
            offset += rdlength
    except (struct.error, IndexError, ValueError):
        return None
    return None


def container_name(ip: str, server: str | None = None, port: int = 53) -> str | None:
    """The first label of the name Docker's DNS gives ``ip`` (the container's name), or None."""
    server = server or nameserver()
    if server is None:
        return None
    name = ptr_name(ip, server, port)
    return name.split(".", 1)[0] if name else None
