"""Block chains of recent prompts, remembered by span, so a prompt that extends a seen one (the
next turn of a conversation) hashes only its new part.

Hashing a chain is one xxh3 call per block from Python: ~400 calls for a 16 KB chat, most of them
for turns the router hashed on the previous request.  Here the token bytes are cut into spans of
``span_blocks`` blocks, and each span gets a key hashed in one xxh3 call over the whole span
(at C speed), chained like the blocks (seeded by the previous span's key, the first
by the namespace seed and the block size).  A span key therefore names the whole prefix up to that
span's end, and the memo maps it to the span's block hashes.  A new prompt walks its span keys
while they hit and reuses those hashes; from the first miss on it hashes block by block, as
``kvroute.common.blocks`` does, and remembers its new full spans.  The result is exactly
``block_hashes(ids, block_size, seed)``; the memo holds ``max_spans`` spans (LRU), about 2.5 KB each
at 64 blocks a span.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from kvroute.common.blocks import chain_from_bytes

_xxh3 = xxhash.xxh3_64_intdigest


def _first_key(block_size: int, seed: int) -> int:
    return _xxh3(b"kvroute-span-%d" % block_size, seed)


class ChainMemo:
    def __init__(self, span_blocks: int = 64, max_spans: int = 8192):
        if span_blocks < 1 or max_spans < 0:
            raise ValueError("span_blocks must be >= 1 and max_spans >= 0")
        self.span_blocks = span_blocks
        self.max_spans = max_spans
        self._spans: OrderedDict[int, list[int]] = OrderedDict()
        self.hits = 0  # spans reused
        self.misses = 0

    def __len__(self) -> int:
        return len(self._spans)

    def chain(self, data: bytes, block_size: int, seed: int) -> list[int]:
        """The chain of ``data`` (tokens as uint32 little-endian), equal to ``chain_from_bytes``."""
        step = block_size * 4 * self.span_blocks
        n_spans = len(data) // step
        if n_spans == 0 or self.max_spans == 0:
            return chain_from_bytes(data, block_size, seed)
        spans = self._spans
        view = memoryview(data)
        key = _first_key(block_size, seed)
        out: list[int] = []
        parent = seed
        done = 0
        while done < n_spans:
            key = _xxh3(view[done * step : (done + 1) * step], key)
            hashes = spans.get(key)
            if hashes is None:
                break
            spans.move_to_end(key)
            out.extend(hashes)
            parent = hashes[-1]
            done += 1
        self.hits += done
        if done == n_spans:
            out.extend(chain_from_bytes(view[done * step :], block_size, parent))
            return out
        # From the first missing span on: hash block by block, remember the new full spans.
        rest = chain_from_bytes(view[done * step :], block_size, parent)
        out.extend(rest)
        self._remember(view, step, key, done, n_spans, rest)
        self.misses += n_spans - done
        return out

    def _remember(self, view: memoryview, step: int, key: int, first: int, n_spans: int, hashes: list[int]) -> None:
        """Spans ``first``..``n_spans`` of ``view`` (``key``: span ``first``'s), ``hashes`` from span ``first`` on."""
        spans = self._spans
        per_span = self.span_blocks
        for j in range(first, n_spans):
            if j > first:
                key = _xxh3(view[j * step : (j + 1) * step], key)
            start = (j - first) * per_span
            spans[key] = hashes[start : start + per_span]
        while len(spans) > self.max_spans:
            spans.popitem(last=False)
