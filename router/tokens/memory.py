"""Giving freed heap back to the operating system after a huge prompt.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated): after the
transient buffers of tokenizing a multi-megabyte prompt are freed, the process's RSS stays up by
hundreds of megabytes until the same threads happen to reuse them.  ``malloc_trim(0)`` returns
free pages of every arena.  Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):
    _trim = None

_lock = threading.Lock()  # one trim at a time: concurrent trims only contend for the same locks


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (glibc), else nothing.  Costs ~1-20 ms."""
    if _trim is not None and _lock.acquire(blocking=False):
        try:
            _trim(0)
        finally:
            _lock.release()
