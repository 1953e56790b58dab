"""Tokenizing a very long piece of text in chunks, so that it costs a few times its size.

``tokenizers`` keeps ~100 bytes per input character while it encodes (alignments per byte, the
tokens' strings and offsets; figures in docs/experiments.md).  So a piece
longer than 1.5 :data:`CHUNK_CHARS` is encoded in chunks, cut only where cutting changes nothing
near the cut: at a candidate position ``p`` (preferably the end of a word, where pre-tokenizers
split), encoding ``text[p-W:p]`` and ``text[p:p+W]`` apart must give exactly the ids of encoding
``text[p-W:p+W]`` whole; where no candidate passes, the chunk grows.  Pre-tokenizers and BPE
decide tokens from the characters close by, so a cut that holds over a window of W = 512
characters holds in the whole text (the tests check it on prose, whitespace runs, CJK and long
words; a case it missed would change the router's block hashes, never an answer: engines
tokenize for themselves).  Counting as it goes, it stops past ``max_tokens``.
"""

from __future__ import annotations

import array
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvroute.common.tokens.errors import PromptTooLong

CHUNK_CHARS = 1 << 17  # 131,072 characters: ~13 MB of tokenizers' transient memory each
SEAM_WINDOW = 512
_SEAM_TRIES = 8
_WORD_END = re.compile(r"\S(?=\s)")

Encode = Callable[[list[str]], Sequence[Any]]  # texts -> tokenizers Encodings (no special tokens)


def is_long(text: str, chunk_chars: int = CHUNK_CHARS) -> bool:
    return len(text) > chunk_chars * 3 // 2


def encode_long(encode: Encode, text: str, max_tokens: int | None = None, chunk_chars: int = CHUNK_CHARS) -> array.array:
    """The ids of ``text`` (uint32), equal to encoding it whole; PromptTooLong past ``max_tokens``."""
    out = array.array("I")
    start = 0
    while start < len(text):
        rest = len(text) - start
        end = len(text) if rest <= chunk_chars * 3 // 2 else _cut(encode, text, start + chunk_chars, chunk_chars)
        out.extend(encode([text[start:end]])[0].ids)
        if max_tokens is not None and len(out) > max_tokens:
            raise PromptTooLong(len(out), max_tokens, at_least=end < len(text))
        start = end
    return out


def _cut(encode: Encode, text: str, target: int, chunk_chars: int) -> int:
    """The first verified cut at or before ``target`` (else before target + a chunk, ...; else the end)."""
    while target < len(text):
        for p in _candidates(text, target):
            a, b = p - SEAM_WINDOW, p + SEAM_WINDOW
            left, right, whole = (e.ids for e in encode([text[a:p], text[p:b], text[a:b]]))
            if left + right == whole:
                return p
        target += chunk_chars
    return len(text)


def _candidates(text: str, target: int) -> list[int]:
    """Word ends just before ``target`` (last first), then plain positions (text without spaces),
    from ``low`` on and a window short of the end."""
    ends = [m.end() for m in _WORD_END.finditer(text, max(0, target - 4096), target)]
    plain = [target - 61 * k for k in range(_SEAM_TRIES)]
    return [p for p in ends[::-1][:_SEAM_TRIES] + plain if SEAM_WINDOW <= p <= len(text) - SEAM_WINDOW]
