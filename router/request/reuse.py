"""The hit-rate breakdown of docs/design.md §6 on a live router: reuse available, and cache-hostile prompts.

*Available* reuse is what one infinite cache shared by every replica would have hit.  A live router
cannot remember every prompt, so it remembers the last ``window_blocks`` block hashes per model
(an LRU set: a hash seen again moves to the front; 200,000 by default, about 3.2M tokens of
distinct prefixes at 16 tokens a block, the KV capacity of some eight H100s serving an 8B model,
and about 28 MB per model).  A prompt's available blocks
are the leading run of its chain found in that set.  Chain hashes already carry the namespace
(model, adapter, cache_salt), so tenants never count each other's prompts.

*Cache-hostile* prompts start with something new (a timestamp, a user id) followed by content the
router has seen before: no engine can reuse it, because a prefix cache matches from the first
token.  Chain hashes cannot see that (every hash after the divergence differs), so the detector keeps
content fingerprints that do not depend on position: a rolling polynomial hash of every window of
``WINDOW`` tokens, kept when its hash falls in a 1/``SAMPLE`` slice (content-defined sampling, so a
shift of the text by any number of tokens keeps the same fingerprints).  Computed with numpy
(wrapping uint64 arithmetic) it costs tens of microseconds for a few thousand tokens, and only
tokens beyond the available prefix are fingerprinted: what was matched was fingerprinted when it
was new.  A prompt is flagged when it diverges from everything seen within its first
``head_blocks`` blocks (8: 128 tokens, where timestamps and user ids sit) while the fingerprints
of the rest estimate at least ``min_stretch_tokens`` tokens, and ``min_stretch_fraction`` of the
rest, as seen before.  The fingerprint set is an LRU of half as many entries as the block window
(one fingerprint per 32 new tokens covers the same history as one hash per 16): about 14 MB more
per model at the default window.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 16  # tokens per fingerprinted window
SAMPLE_BITS = 5
SAMPLE = 1 << SAMPLE_BITS  # one window in SAMPLE (by hash value) is kept as a fingerprint
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, hence invertible modulo 2**64
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


class _Powers:
    """B**i and B**-i modulo 2**64, grown on demand (prompts get long; compute once)."""

    def __init__(self) -> None:
        self.pos = np.ones(1, dtype=np.uint64)
        self.neg = np.ones(1, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        if len(self.pos) >= n:
            return
        size = max(n, 2 * len(self.pos))
        with np.errstate(over="ignore"):
            self.pos = np.cumprod(np.full(size, _BASE, dtype=np.uint64), dtype=np.uint64) * _BASE_INV
            self.neg = np.cumprod(np.full(size, _BASE_INV, dtype=np.uint64), dtype=np.uint64) * _BASE


_powers = _Powers()


# A prompt this short (a one-line chat) is fingerprinted with Python ints: numpy's ~15 calls cost
# a fixed ~10 us, more than the few windows' arithmetic; the same values (tests/test_router_reuse.py)
SMALL_TOKENS = 2 * WINDOW - 1
_M64 = (1 << 64) - 1
_POS_INT = [pow(int(_BASE), i, 1 << 64) for i in range(SMALL_TOKENS)]
_NEG_INT = [pow(int(_BASE_INV), i, 1 << 64) for i in range(SMALL_TOKENS)]
_MIX_INT = int(_MIX)


def small_fingerprints(token_ids: Sequence[int], seed: int = 0) -> list[int]:
    """:func:`fingerprints` of at most ``SMALL_TOKENS`` tokens, as a list, without numpy."""
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
    n = len(ids)
    prefix = [0]
    acc = 0
    for i in range(n):
        acc = (acc + (ids[i] + 1) * _POS_INT[i]) & _M64
        prefix.append(acc)
    kept = []
    salt = seed & _M64
    for j in range(n - WINDOW + 1):
        h = ((prefix[j + WINDOW] - prefix[j]) * _NEG_INT[j]) & _M64
        h ^= h >> 31
        h = (h * _MIX_INT) & _M64
        h ^= h >> 29
        if h >> (64 - SAMPLE_BITS) == 0:
            kept.append(h ^ salt)
    return kept


def fingerprints(token_ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """Sampled content hashes of every WINDOW-token window (independent of the window's position)."""
    n = len(token_ids)
    if n < WINDOW:
        return np.empty(0, dtype=np.uint64)
    _powers.ensure(n + 1)
    t = token_ids.astype(np.uint64) + np.uint64(1)  # token 0 must still count
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(t * _powers.pos[:n], dtype=np.uint64, out=prefix[1:])
        h = (prefix[WINDOW:] - prefix[: n - WINDOW + 1]) * _powers.neg[: n - WINDOW + 1]
        h ^= h >> np.uint64(31)  # mix so that low bits depend on every token of the window
        h *= _MIX
        h ^= h >> np.uint64(29)
    kept = h[(h >> np.uint64(64 - SAMPLE_BITS)) == 0]
    return kept ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)


class _LruSet:
    __slots__ = ("items", "cap")

    def __init__(self, cap: int):
        self.items: OrderedDict[int, None] = OrderedDict()
        self.cap = cap

    def add_all(self, keys: Sequence[int]) -> None:
        """Insert or refresh ``keys``."""
        items = self.items
        for k in keys:
            if k in items:
                items.move_to_end(k)
            else:
                items[k] = None
        for _ in range(len(items) - self.cap):
            items.popitem(last=False)

    def refresh_leading_run(self, keys: Sequence[int]) -> int:
        """Refresh the leading run of ``keys`` the set holds and return its length: one C loop
        that stops at the first key not held (a chain's hashes are distinct)."""
        try:
            deque(map(self.items.move_to_end, keys), maxlen=0)
        except KeyError as missing:
            return keys.index(missing.args[0])
        return len(keys)

    def count_in(self, keys: Sequence[int]) -> int:
        return sum(map(self.items.__contains__, keys))

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class ReuseObservation:
    available_blocks: int  # leading blocks some earlier prompt in the window shared
    cache_hostile: bool


def _array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.uint32)


class ReuseTracker:
    """Per-model windows of recent block hashes and content fingerprints."""

    def __init__(
        self,
        window_blocks: int = 200_000,
        head_blocks: int = 8,
        min_stretch_tokens: int = 256,
        min_stretch_fraction: float = 0.25,
    ):
        self.window_blocks = window_blocks
        self.head_blocks = head_blocks
        self.min_stretch_tokens = min_stretch_tokens
        self.min_stretch_fraction = min_stretch_fraction
        self._blocks: dict[str, _LruSet] = {}
        self._prints: dict[str, _LruSet] = {}

    def _sets(self, model: str) -> tuple[_LruSet, _LruSet]:
        blocks = self._blocks.get(model)
        if blocks is None:
            blocks = self._blocks[model] = _LruSet(self.window_blocks)
            # one fingerprint per SAMPLE new tokens, one block per 16: the same history
            self._prints[model] = _LruSet(max(1, self.window_blocks * 16 // SAMPLE))
        return blocks, self._prints[model]

    def observe(
        self, model: str, chain: Sequence[int], token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int
    ) -> ReuseObservation:
        """Count this prompt's available reuse, flag it if cache-hostile, then remember it."""
        blocks, prints = self._sets(model)
        available = blocks.refresh_leading_run(chain)
        # Only what is new gets fingerprinted: a matched prefix was fingerprinted when it was new.
        start = available * block_size
        rest = token_ids[start:]
        if len(rest) < WINDOW:
            new: list[int] = []
        elif len(rest) <= SMALL_TOKENS:
            new = small_fingerprints(rest, seed)
        else:
            new = fingerprints(_array(rest), seed).tolist()
        hostile = bool(chain) and available < self.head_blocks and self._is_hostile(prints, new, len(token_ids) - start)
        blocks.add_all(chain[available:])
        prints.add_all(new)
        return ReuseObservation(available_blocks=available, cache_hostile=hostile)

    def _is_hostile(self, prints: _LruSet, rest: list[int], rest_tokens: int) -> bool:
        if not rest:
            return False
        seen_tokens = prints.count_in(rest) * SAMPLE  # each fingerprint stands for SAMPLE windows
        return seen_tokens >= self.min_stretch_tokens and seen_tokens >= self.min_stretch_fraction * rest_tokens

    def window_size(self, model: str) -> int:
        blocks = self._blocks.get(model)
        return len(blocks) if blocks else 0
