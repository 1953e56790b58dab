"""Giving freed heap back to the operating system after a huge prompt.

glibc's malloc keeps freed memory: a buffer over its mmap threshold is mapped on its own and
unmapped when freed, but the threshold rises to the size of each such buffer freed (up to 32 MB),
so after one 15 MB request body the next ones come from the heap and stay there (figures in
docs/experiments.md).  Tokenizing in the
pool's threads also leaves free pages in their arenas.  :func:`keep_large_buffers_mapped` fixes
the threshold at 1 MiB; :func:`release_free_memory` (``malloc_trim(0)``) returns the free pages
of every arena.  Elsewhere than glibc (musl, macOS) both do nothing.

Fixing the mmap threshold also fixes glibc's trim threshold, at 128 KiB: each arena then handed
back the free top of its heap after every prompt and faulted it in again on the next one (a new
16 KB prompt: ~1.6 MB of tokenizers' transient buffers, ~400 page faults, ~0.3-0.5 ms more CPU
than the same encode with glibc's defaults; docs/experiments.md).  So the trim threshold is set
too, at 8 MiB: what a prompt of up to ~64 KB tokenizes in stays mapped for the next one; larger
prompts and refused bodies still call :func:`release_free_memory`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers, glibc's malloc.h
_MMAP_THRESHOLD_BYTES = 1 << 20
_TRIM_THRESHOLD_BYTES = 8 << 20

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _mallopt = _libc.mallopt
    _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
except (OSError, AttributeError):
    _trim = _mallopt = None

_lock = threading.Lock()  # one trim at a time: concurrent trims only contend for the same locks


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (glibc), else nothing.  Costs ~1-20 ms."""
    if _trim is not None and _lock.acquire(blocking=False):
        try:
            _trim(0)
        finally:
            _lock.release()


def keep_large_buffers_mapped() -> None:
    """Buffers of 1 MiB and more (request bodies, big prompts) are mapped on their own and go
    back to the OS when freed: the threshold no longer follows the largest buffer freed.  Up to
    8 MiB free at the top of each arena stays mapped (a new prompt's transient buffers)."""
    if _mallopt is not None:
        _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        _mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
