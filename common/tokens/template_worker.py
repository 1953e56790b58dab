"""The worker process that renders clients' chat templates (started by common/tokens/client_templates.py).

It reads length-prefixed msgpack :class:`RenderJob` frames on stdin and answers one frame each on
stdout: ``{"text": …}``, ``{"error": …}`` (the template failed, as the model's own may) or
``{"refused": …, "code": …}`` (over a budget).  The parent times each job and kills this process
when it overruns; here the output is bounded as it is generated, and the address space by an
rlimit, so a template cannot take the host's memory either.
"""

from __future__ import annotations

import ctypes
import resource
import signal
import struct
import sys
from typing import Any, BinaryIO

import msgspec

from kvroute.common.tokens.chat_template import ChatTemplateError, OutputTooLarge, RenderJob, render

HEADER = struct.Struct(">I")
# Address space of the worker: its interpreter and imports map ~160 MB, the rest is
# for one render (16 M characters are up to 64 MB as a str, a few times over while joined).
ADDRESS_SPACE_BYTES = 2 << 30


def write_frame(out: BinaryIO, payload: bytes) -> None:
    out.write(HEADER.pack(len(payload)) + payload)
    out.flush()


def read_frame(src: BinaryIO) -> bytes | None:
    head = src.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = src.read(size)
    return body if len(body) == size else None


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the router dies, even mid-render."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def answer(job: RenderJob, max_chars: int) -> dict[str, Any]:
    try:
        return {"text": render(job, max_chars=max_chars)}
    except OutputTooLarge as exc:
        return {"refused": str(exc), "code": "chat_template_output_too_large"}
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    except MemoryError:
        raise  # main() answers it and exits: what is left allocated is unknown
    except RecursionError:
        return {"refused": "the chat template recursed too deeply", "code": "chat_template_too_deep"}
    except Exception as exc:  # noqa: BLE001 - a client's template may raise anything: report it
        return {"error": f"chat template failed: {exc!r}"}


def main(argv: list[str]) -> int:
    """``argv[1]``: the output budget in characters."""
    max_chars = int(argv[1])
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    src, out = sys.stdin.buffer, sys.stdout.buffer
    decode = msgspec.msgpack.Decoder(RenderJob).decode
    encode = msgspec.msgpack.Encoder().encode
    write_frame(out, encode({"ready": True}))  # imports done: the parent's clock may start
    while (frame := read_frame(src)) is not None:
        try:
            reply = answer(decode(frame), max_chars)
        except MemoryError:
            # what is left allocated is unknown: answer, then exit; the parent starts a fresh worker
            write_frame(out, encode({"refused": "the chat template used more memory than allowed", "code": "chat_template_memory_exceeded"}))
            return 1
        except msgspec.DecodeError as exc:
            reply = {"error": f"bad job: {exc}"}
        write_frame(out, encode(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
