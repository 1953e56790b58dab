"""Where a prompt is cut, and the token ids of the pieces already seen.

``tokenizers`` cuts its input at every added token matched on the raw text before it runs the
model on each piece between them (see common/tokens/tokenizer.py): :class:`Splitter` cuts the
same way, and :class:`SegmentCache` keeps the ids of pieces seen before (earlier turns, shared
system prompts) as uint32 arrays.
"""

from __future__ import annotations

import array
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken

from kvroute.common.blocks import token_bytes

DEFAULT_CACHE_MAX_CHARS = 8_000_000
DEFAULT_CACHE_MAX_ENTRIES = 200_000

# Rust's `char::is_whitespace` / regex `\s` (Unicode White_Space), which tokenizers uses for the
# lstrip/rstrip of added tokens.  Python's str.isspace() differs (it also counts \x1c-\x1f).
UNICODE_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"

# Segments' ids are kept as uint32 arrays where the machine's native layout is little-endian
# uint32: a prompt's token bytes (what block hashing reads) are then one C join of the cached
# arrays, instead of a list of thousands of ints built and converted on every request.
U32_NATIVE = array.array("I").itemsize == 4 and sys.byteorder == "little"


def ids_array(ids: Iterable[int]) -> Sequence[int]:
    return array.array("I", ids) if U32_NATIVE else tuple(ids)


def to_bytes(pieces: Sequence[Sequence[int]]) -> bytes:
    """Pieces of ids as uint32 little-endian bytes, joined in C where the arrays are native."""
    if U32_NATIVE:
        return b"".join(pieces)  # type: ignore[arg-type]  # arrays of uint32
    return token_bytes([i for piece in pieces for i in piece])



# --------------------------------------------------------------------------------------------
# Segment cache


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    chars: int = 0


class SegmentCache:
    """Token ids of text segments, least recently used first out.

    Bounded by the total characters of the cached segments and by the number of entries; one lock
    guards it so the sync API may be called from several threads.
    """

    def __init__(self, max_chars: int = DEFAULT_CACHE_MAX_CHARS, max_entries: int = DEFAULT_CACHE_MAX_ENTRIES):
        if max_chars < 0 or max_entries < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_chars = max_chars
        self.max_entries = max_entries
        # A segment larger than this is not cached: it would flush most of the cache for one entry.
        self.max_segment_chars = max_chars // 4
        self._data: OrderedDict[str, Sequence[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, segment: str) -> bool:
        return segment in self._data

    @property
    def chars(self) -> int:
        return self._chars

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._stats.hits, self._stats.misses, self._stats.evictions, len(self._data), self._chars)

    def lookup(self, segments: Sequence[str]) -> list[Sequence[int] | None]:
        """The cached ids of each segment (None where absent); hits become most recently used."""
        data = self._data
        out: list[Sequence[int] | None] = []
        hits = 0
        with self._lock:
            for seg in segments:
                ids = data.get(seg)
                if ids is not None:
                    data.move_to_end(seg)
                    hits += 1
                out.append(ids)
            self._stats.hits += hits
            self._stats.misses += len(segments) - hits
        return out

    def store(self, segments: Sequence[str], ids_lists: Sequence[Sequence[int]]) -> None:
        data = self._data
        with self._lock:
            for seg, ids in zip(segments, ids_lists):
                size = len(seg)
                if size > self.max_segment_chars or self.max_entries == 0:
                    continue
                old = data.pop(seg, None)
                if old is not None:
                    self._chars -= size
                data[seg] = ids_array(ids)
                self._chars += size
            while data and (self._chars > self.max_chars or len(data) > self.max_entries):
                seg, _ = data.popitem(last=False)
                self._chars -= len(seg)
                self._stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._chars = 0


# --------------------------------------------------------------------------------------------
# Splitting a prompt at added tokens, as tokenizers does


class Splitter:
    """Cuts text where tokenizers' added-vocabulary pass cuts it (tokens matched on the raw text).

    ``split(text)`` returns ``[text_0, token_1, text_1, ..., token_n, text_n]``: the odd entries
    are added tokens (their ids are known), the even ones the text between them, which tokenizers
    encodes independently.  Matching is leftmost-longest like tokenizers' Aho-Corasick automaton
    (alternatives sorted longest first); lstrip/rstrip tokens absorb the adjacent whitespace as
    tokenizers does (rstrip of the left token first, then lstrip of the right one).
    """

    def __init__(self, tokens: Mapping[str, AddedToken]):
        self.ids: dict[str, int] = {}
        self._pattern: re.Pattern[str] | None = None
        self._lstrip = frozenset(c for c, t in tokens.items() if t.lstrip)
        self._rstrip = frozenset(c for c, t in tokens.items() if t.rstrip)
        if tokens:
            alternatives = sorted(tokens, key=lambda c: (-len(c), c))
            self._pattern = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

    def split(self, text: str) -> list[str]:
        if self._pattern is None:
            return [text]
        parts = self._pattern.split(text)
        if self._lstrip or self._rstrip:
            for i in range(1, len(parts), 2):
                tok = parts[i]
                if tok in self._rstrip:
                    parts[i + 1] = parts[i + 1].lstrip(UNICODE_WHITESPACE)
                if tok in self._lstrip:
                    parts[i - 1] = parts[i - 1].rstrip(UNICODE_WHITESPACE)
        return parts


def unsafe_to_split(config: dict, split_tokens: Iterable[AddedToken], split_special_tokens: bool) -> str | None:
    """Why splitting at added tokens would not reproduce whole-string encoding, or None."""

    def walk(node: Any) -> Iterable[dict]:
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for comp in ("normalizer", "pre_tokenizer"):
        for node in walk(config.get(comp)):
            # Metaspace(prepend_scheme="first") prepends only to the piece at offset 0 of the input.
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return "Metaspace pre-tokenizer with prepend_scheme='first'"
    model = config.get("model") or {}
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout is random"
    tokens = list(split_tokens)
    if any(t.single_word for t in tokens):
        return "single_word added tokens (word-boundary rules)"
    if split_special_tokens:
        return "split_special_tokens is set"
    if any(t.lstrip or t.rstrip for t in tokens) and any(t.content != t.content.strip(UNICODE_WHITESPACE) for t in tokens):
        return "added tokens that begin or end with whitespace next to lstrip/rstrip tokens"
    return None

