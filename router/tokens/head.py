"""A prompt's ids known up to a verified cut: what routing needs of a long new prompt, now.

A prompt seen before is mostly cached segments (router/tokens/segments.py) and costs little to
encode.  A long new one (a RAG document, a tool's output) is one long segment nobody cached, and
encoding all of it before routing cost milliseconds in front of every first token, though routing
only needs the chain as far as some replica could hold it.  :class:`PromptHead` encodes the
cached pieces and the first :data:`HEAD_CHARS` characters of the first long new segment, cut
where cutting changes no id (``long_text.encode_head``): its ids are exactly the first ids of
the whole prompt.  Routing hashes them, asks the index, and calls :meth:`PromptHead.grow` while
some replica holds every block of the head; :meth:`PromptHead.finish` (on the pool, after the
request has left) encodes the rest from the cut on and caches the segments, as encoding the
whole prompt would have: the ids are identical (tests/test_tokens.py proves it on random texts,
cuts and chats).
"""

from __future__ import annotations

import array
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..blocks import token_bytes
from .long_text import encode_head, encode_long, is_long
from .segments import U32_NATIVE, ids_array

if TYPE_CHECKING:
    from .tokenizer import Tokenizer, _Plan

HEAD_CHARS = 256  # new characters encoded before routing (x4 on each grow): some 6 blocks of 16 tokens
# The cut is verified over this many characters to its right (the left side is the whole prefix).
# Less than long_text's seams (512): it is paid on the request's path, and the cut's candidates
# are word ends, where the pre-tokenizers of byte-level BPEs (GPT-2's rules, Llama 3's, Qwen's)
# start a new piece whatever follows; the property tests vary texts, cuts and grows.
HEAD_WINDOW = 128
GROW_FACTOR = 4
# A prompt is routed on its head only when this much of it is new, in one segment this long:
# below, encoding it whole costs about what the verified cut does.
PARTIAL_MIN_CHARS = 4096
# New segments before the long one are encoded with the head; more than this: encode it whole.
MAX_CHARS_BEFORE = 4096


def to_bytes(pieces: Sequence[Sequence[int]]) -> bytes:
    """Pieces of ids as uint32 little-endian bytes, joined in C where the arrays are native."""
    if U32_NATIVE:
        return b"".join(pieces)  # type: ignore[arg-type]  # arrays of uint32
    return token_bytes([i for piece in pieces for i in piece])


class PromptHead:
    """The first ids of a prompt (``data``: uint32 LE bytes), the rest encoded by :meth:`finish`.

    Built by :meth:`Tokenizer.head` only; ``done`` once ``data`` is the whole prompt.
    """

    def __init__(self, tok: Tokenizer, plan: _Plan, long_index: int):
        self._tok = tok
        self._plan = plan
        self._long = long_index  # plan.parts[long_index]: the long new segment the head cuts
        parts = plan.parts
        # what follows the long segment, for the estimate: ids known (cached) and characters not
        after = parts[long_index + 1 :]
        self._ids_after = sum(len(p) for p in after if not isinstance(p, str)) + len(tok._suffix or ()) * plan.wrap
        self._chars_after = sum(len(p) for p in after if isinstance(p, str))
        before = [p for p in parts[:long_index] if isinstance(p, str)]
        self._before = dict(zip(before, tok._encode_plain(before))) if before else {}
        self._known = [p if not isinstance(p, str) else ids_array(self._before[p].ids) for p in parts[:long_index]]
        if plan.wrap and tok._prefix:
            self._known.insert(0, ids_array(tok._prefix))
        self._known_bytes = to_bytes(self._known)
        self.data = b""
        self.done = False
        self._cut = 0
        self._ids: list[int] = []

    def start(self) -> bool:
        """Encode the head; False when no cut verifies near its start (encode the prompt whole)."""
        return self._cut_at(HEAD_CHARS)

    @property
    def segment(self) -> str:
        return self._plan.parts[self._long]

    def _cut_at(self, target: int) -> bool:
        """Encode the long segment up to a verified cut near ``target``; False if none verifies."""
        found = encode_head(self._tok._encode_plain, self.segment, target, HEAD_WINDOW)
        if found is None:
            return False
        self._cut, self._ids = found
        self.data = self._known_bytes + to_bytes([ids_array(self._ids)])
        return True

    @property
    def tokens_estimate(self) -> int:
        """The whole prompt's tokens, estimated from the head's ids per character (exact once done)."""
        n = len(self.data) // 4
        if self.done:
            return n
        rest = len(self.segment) - self._cut + self._chars_after
        return n + self._ids_after + math.ceil(rest * len(self._ids) / self._cut)

    def grow(self) -> bool:
        """Encode further (``GROW_FACTOR`` times the head's new characters); when the segment is
        nearly all encoded, the whole prompt.  False if it was already whole."""
        if self.done:
            return False
        before = self._cut
        # from a short verified cut (text without word ends may verify only near its start), grow
        # as from a full head; a cut that does not move on ends the growing: each grow progresses
        target = max(before, HEAD_CHARS) * GROW_FACTOR
        if target + 2 * HEAD_WINDOW >= len(self.segment) or not self._cut_at(target) or self._cut <= before:
            self.data = self.finish()
        return True

    def finish(self) -> bytes:
        """The whole prompt's ids (any thread; the batch encoders release the GIL): the long
        segment from the cut on, the other new segments, all cached as whole-prompt encoding
        caches them."""
        tok, plan = self._tok, self._plan
        seg = self.segment
        rest = seg[self._cut :]
        ids = array.array("I", self._ids) if U32_NATIVE else list(self._ids)
        ids.extend(encode_long(tok._encode_plain, rest) if is_long(rest) else tok._encode_plain([rest])[0].ids)
        others = [s for s in plan.missing if s != seg and s not in self._before]
        encoded: dict[str, Any] = {s: ids_array(e.ids) for s, e in self._before.items()}
        if others:
            encoded.update(zip(others, tok._encode_new(type(plan)([], others))))
        encoded[seg] = ids_array(ids)
        self.done = True
        return to_bytes(tok._join(plan, [encoded[s] for s in plan.missing]))


def long_segment(plan: _Plan) -> int | None:
    """Where a plan's first long new segment is, if routing on a head of it pays; else None."""
    if plan.whole or sum(map(len, plan.missing)) < PARTIAL_MIN_CHARS:
        return None
    before = 0
    for i, part in enumerate(plan.parts):
        if isinstance(part, str):
            if len(part) >= HEAD_CHARS + 4 * HEAD_WINDOW:
                return i
            before += len(part)
            if before > MAX_CHARS_BEFORE:
                return None
    return None


def byte_level_expansion(config: dict) -> int | None:
    """For :meth:`Tokenizer.tokens_at_most`: how many times its UTF-8 bytes a text may grow
    before a byte-level BPE (at least one byte a token) encodes it: 1 without a normalizer, 3
    with NFC (UAX #15's bound); None for any other tokenizer (no bound: encode to count)."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(config.get("pre_tokenizer")):
        return None
    norm = config.get("normalizer")
    steps = norm.get("normalizers", []) if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm]
    kinds = {s.get("type") for s in steps if isinstance(s, dict)}
    if len(kinds) < sum(s is not None for s in steps) or not kinds <= {"NFC"}:
        return None
    return 3 if kinds else 1
