"""Lower bounds on a prompt's token count, known before it is tokenized (docs/design.md §7.5).

A prompt over the length limit is refused; finding that by tokenizing it costs what the whole
prompt costs (a chat of 200,000 one-character messages: 2.1 M tokens, seconds of CPU, the event
loop stalled by its render).  Two bounds that never exceed the real count refuse most such
prompts at once:

* characters: a token covers at most the characters of the longest entry of the vocabulary (its
  added tokens included), so a text of ``n`` characters is at least ``n / longest`` tokens, when
  nothing on the way drops characters.  A normalizer may shrink the text: Unicode composition
  (NFC, NFKC) by at most 4 to 1 (the longest canonical decomposition is 4 code points), a literal
  ``Replace`` by its pattern's length over its content's; every other normalizer, a
  pre-tokenizer that drops what it splits on (whitespace), and a model that maps an unknown run
  of any length to one token (WordPiece, WordLevel, a fused unknown without byte fallback) give no
  bound (``None``).
* messages: the model's chat template marks each message with special tokens (``<|im_start|>``
  and ``<|im_end|>``, Llama 3's header and end-of-turn tokens), each of which is exactly one token
  whatever the text around it.  The count a message of each role adds is probed at load time by
  rendering small chats; a role the probe cannot render counts 0.  A chat's messages then add up
  to a lower bound read from their roles alone, before the chat is rendered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# Unicode composition joins at most this many code points into one (a base and three marks).
_COMPOSITION_SHRINK = 4
_SAFE_PRETOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Sequence", "Split", "Punctuation"}
PROBED_ROLES = ("system", "user", "assistant", "tool")


def _normalizer_shrink(node: Mapping[str, Any] | None) -> float | None:
    """How many characters of input at most become one of output (None: no bound)."""
    if node is None:
        return 1.0
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1.0
        for child in node.get("normalizers", []):
            f = _normalizer_shrink(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFC", "NFKC", "NFD", "NFKD"):
        return float(_COMPOSITION_SHRINK)
    if kind in ("Lowercase", "Prepend", "ByteLevel"):
        return 1.0
    if kind == "Replace":
        pattern, content = node.get("pattern", {}), node.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, Mapping) else None
        if not isinstance(literal, str) or not literal or not content:
            return None  # a regex may match any length; an empty content drops what it matches
        return max(1.0, len(literal) / len(content))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled (sentencepiece's map), unknown kinds


def _pretokenizer_keeps_everything(node: Mapping[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind not in _SAFE_PRETOKENIZERS:
        return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop what they split on
    if str(node.get("behavior", "")).lower() == "removed":
        return False
    return all(_pretokenizer_keeps_everything(child) for child in node.get("pretokenizers", []))


def max_chars_per_token(config: Mapping[str, Any], added: Iterable[str]) -> int | None:
    """The most characters of input one token can stand for (``tokenizer.json``'s ``config``),
    or None when some step may drop characters or cover a run of any length with one token."""
    model = config.get("model") or {}
    kind = model.get("type")
    byte_level = "ByteLevel" in str(config.get("pre_tokenizer"))
    if kind == "BPE":
        if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback") and not byte_level:
            return None
    elif kind == "Unigram":
        if not model.get("byte_fallback"):
            return None  # unknown characters fuse into one token
    else:
        return None  # WordPiece, WordLevel: one unknown token for a word of any length
    if not _pretokenizer_keeps_everything(config.get("pre_tokenizer")):
        return None
    shrink = _normalizer_shrink(config.get("normalizer"))
    if shrink is None:
        return None
    vocab = model.get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, Mapping) else (entry[0] for entry in vocab)  # Unigram: [piece, score]
    longest = int(max((len(p) for p in pieces), default=1) * shrink + 0.999)
    return max([longest, *(len(a) for a in added)])  # added tokens are matched before normalizing


def probe_message_tokens(render: Callable[[list[dict[str, str]]], str], count: Callable[[str], int]) -> dict[str, int]:
    """The special tokens one more message of each role adds to a chat, at least (``render``: the
    model's template over messages; ``count``: special tokens in a text).  Measured at two
    positions after a user/assistant exchange, the smaller kept; 0 where the template refuses."""

    def specials(messages: list[dict[str, str]]) -> int | None:
        try:
            return count(render(messages))
        except Exception:  # noqa: BLE001 - any template error: this probe says nothing
            return None

    def msg(role: str) -> dict[str, str]:
        return {"role": role, "content": "x"}

    out: dict[str, int] = {}
    for role in PROBED_ROLES:
        # after a user/assistant exchange (and a user turn before an assistant one), two messages of
        # the role, each followed by what alternation needs before the next (user and assistant
        # alternate; system and tool messages follow each other as they are)
        prefix = [msg("user"), msg("assistant")] + ([msg("user")] if role == "assistant" else [])
        between = {"user": [msg("assistant")], "assistant": [msg("user")]}.get(role, [])
        chats = [prefix, prefix + [msg(role)], prefix + [msg(role)] + between,
                 prefix + [msg(role)] + between + [msg(role)]]
        counts = [specials(chat) for chat in chats]
        if None in counts:
            out[role] = 0
            continue
        out[role] = max(0, min(counts[1] - counts[0], counts[3] - counts[2]))  # type: ignore[operator]
    return out


def chat_tokens_at_least(message_tokens: Mapping[str, int], roles: Sequence[Any]) -> int:
    """A lower bound on a chat's tokens from its messages' roles alone."""
    get = message_tokens.get
    return sum(get(role, 0) if type(role) is str else 0 for role in roles)
