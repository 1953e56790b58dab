"""The text the emulated replica "generates": deterministic filler, one token piece per output token."""

from __future__ import annotations

from kvroute.common.tokens import Tokenizer

# Readable, ASCII (one piece per token decodes cleanly).
FILLER_TEXT = (
    " The quick brown fox jumps over the lazy dog while the router keeps every prefix warm in the"
    " cache, and each replica answers with the same patient filler text until its tokens run out."
)


class Filler:
    """Deterministic output: FILLER_TEXT's tokens cycled, starting where the prompt length points."""

    def __init__(self, tokenizer: Tokenizer):
        ids = [i for i in tokenizer.encode_prompt(FILLER_TEXT, add_special_tokens=False)
               if tokenizer.decode([i], skip_special_tokens=True)]
        if not ids:
            raise ValueError("the tokenizer decodes no filler token")
        self.ids = ids
        self._pieces = [tokenizer.decode([i]) for i in ids]

    def text(self, prompt_len: int, start: int, count: int) -> str:
        n = len(self.ids)
        return "".join(self._pieces[(prompt_len + k) % n] for k in range(start, start + count))
