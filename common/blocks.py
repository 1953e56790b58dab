"""Block-chain hashing: token ids -> one hash per full block (docs/design.md §2.1).

h_0 is the namespace seed (scheme, model, LoRA adapter, cache_salt); block i hashes its tokens as
uint32 little-endian with xxh3-64 seeded by h_{i-1}.  A prefix of the prompt is therefore the
chain's first k hashes, and two namespaces never share a chain.  The trailing partial block is not
hashed: engines only cache full blocks.
"""

from __future__ import annotations

import array
import functools
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

# Goes into every index key name: a change of scheme must never mix with old entries.
HASH_SCHEME = "x3c1"

_xxh3 = xxhash.xxh3_64_intdigest
_U32 = np.dtype("<u4")
# array.array packs a list of ints about twice as fast as numpy; usable where 'I' is uint32 LE.
_ARRAY_OK = array.array("I").itemsize == 4 and sys.byteorder == "little"


@functools.lru_cache(maxsize=65536)  # per request otherwise; a fleet has few namespaces (tenants)
def namespace_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of a chain's first block: one namespace per (model, adapter, tenant salt)."""
    key = "\x1f".join((HASH_SCHEME, model, lora or "", cache_salt or ""))
    return _xxh3(key.encode())


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as contiguous uint32 little-endian bytes."""
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype=_U32).tobytes()
    if _ARRAY_OK:
        return array.array("I", token_ids).tobytes()
    return np.fromiter(token_ids, dtype=_U32, count=len(token_ids)).tobytes()


def chain_from_bytes(data: bytes, block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks in ``data`` (uint32 LE tokens), chained from ``parent``."""
    step = block_size * 4
    end = len(data) - len(data) % step
    view = memoryview(data)
    out = []
    append = out.append
    h = parent
    for off in range(0, end, step):
        h = _xxh3(view[off : off + step], h)
        append(h)
    return out


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int) -> list[int]:
    """The block chain of a prompt: one hash per full block of ``block_size`` tokens."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return chain_from_bytes(token_bytes(token_ids), block_size, seed)


def extend_chain(parent: int, token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Continue a chain from a known parent hash (KV events: parent hash + the block's tokens)."""
    return block_hashes(token_ids, block_size, parent)


def hash_block(parent: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """The hash of one block whose parent's hash is known."""
    return _xxh3(token_bytes(token_ids), parent)
