"""`kvroute replica --name-from-dns` (replica/container_name.py): the name Docker's DNS gives the
container's IP, asked with a PTR query over UDP, against a DNS server on loopback answering as
Docker's embedded one does (`<container>.<network>` for a container's address, NXDOMAIN for
another); a real socket and the wire format of RFC 1035, name compression included."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest

from kvroute.replica.cli import _name_from_dns, build_parser
from kvroute.replica.container_name import container_name, nameserver, ptr_name


def encode(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p) + b"\0"


class DockerLikeDns:
    """A DNS server on 127.0.0.1 answering PTR queries from ``names`` (IP -> name), NXDOMAIN for
    any other; it keeps the questions it got (name, type)."""

    def __init__(self, names: dict[str, str]):
        self.reverse = {".".join(reversed(ip.split("."))) + ".in-addr.arpa": name for ip, name in names.items()}
        self.questions: list[tuple[str, int]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # the loop sees the stop at once
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> DockerLikeDns:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            qid = struct.unpack("!H", query[:2])[0]
            offset, labels = 12, []
            while query[offset]:
                labels.append(query[offset + 1:offset + 1 + query[offset]].decode())
                offset += 1 + query[offset]
            question = query[12:offset + 5]
            qname, qtype = ".".join(labels), struct.unpack("!H", query[offset + 1:offset + 3])[0]
            self.questions.append((qname, qtype))
            target = self.reverse.get(qname) if qtype == 12 else None
            if target is None:
                self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question, peer)
                continue
            rdata = encode(target)
            # the answer's owner name is a pointer to the question's (offset 12), as servers write it
            answer = struct.pack("!HHHIH", 0xC00C, 12, 1, 600, len(rdata)) + rdata
            self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer, peer)


def test_the_container_name_is_the_first_label_of_the_ptr_answer():
    with DockerLikeDns({"172.18.0.5": "kvroute-replica-emulated-3.kvroute_default"}) as dns:
        assert ptr_name("172.18.0.5", "127.0.0.1", dns.port) == "kvroute-replica-emulated-3.kvroute_default"
        assert container_name("172.18.0.5", "127.0.0.1", dns.port) == "kvroute-replica-emulated-3"
        assert container_name("172.18.0.9", "127.0.0.1", dns.port) is None  # NXDOMAIN: no name
    assert dns.questions[0] == ("5.0.18.172.in-addr.arpa", 12)


def test_no_answer_is_no_name(tmp_path: Path):
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        assert ptr_name("172.18.0.5", "127.0.0.1", silent.getsockname()[1], timeout=0.2) is None
    finally:
        silent.close()
    conf = tmp_path / "resolv.conf"
    conf.write_text("# Docker's\nsearch example\nnameserver 127.0.0.11\nnameserver 10.0.0.2\noptions ndots:0\n")
    assert nameserver(conf) == "127.0.0.11" and nameserver(tmp_path / "missing") is None


def test_the_launcher_registers_under_the_container_name_or_its_hostname():
    """`kvroute replica --name-from-dns` with the advertised IP: the container's name when DNS
    has one, this host's name when it has none; never with --name."""
    parser = build_parser()
    args = parser.parse_args(["--model", "m", "--advertise-host", "127.0.0.1", "--name-from-dns"])
    with DockerLikeDns({"127.0.0.1": "kvroute-replica-gpu-0-1.kvroute_default."}) as dns:
        assert _name_from_dns(args, parser, "127.0.0.1", dns.port) == "kvroute-replica-gpu-0-1"
    with DockerLikeDns({}) as dns:
        assert _name_from_dns(args, parser, "127.0.0.1", dns.port) == socket.gethostname()
    with pytest.raises(SystemExit):
        _name_from_dns(parser.parse_args(["--model", "m", "--name", "x", "--name-from-dns"]), parser)
