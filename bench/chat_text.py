"""Text shaped like what users paste into a chat: prose, code, tables, JSON, CJK, identifiers.

Deterministic from a key (any tuple of ints), so a replayed workload and the test that uses it
send the same characters on every machine.  A text is a run of paragraphs, each of one style
drawn by weight, so characters per token vary along one message as they do in real traffic: a
tokenizer turns 1,000 characters of English into far fewer tokens than 1,000 characters of
numbers or CJK.  A router that estimated a message's tokens from its first characters would be
wrong by a factor of several on such text (docs/design.md §1), which is what these texts are
for besides their volume.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Common English words (the text of replayed traces uses the same list: bench/demo_chat.py).
from kvroute.bench.demo_chat import WORDS

_WORDS = np.array(WORDS)
_IDENTS = np.array("get set value node buf cfg idx tmp item key data result request cache block token seq".split())
_CJK = np.array(list("日本語の文章を東京大阪で書いた中文字符串和数据缓存路由请求块的一是在不了有人这"))
_HEX = np.array(list("0123456789abcdef"))

STYLES = ("prose", "code", "table", "json", "cjk", "ids")
DEFAULT_WEIGHTS = (0.55, 0.15, 0.1, 0.08, 0.06, 0.06)
# What users paste after a line or two of instruction: one kind of material at a time.
PASTE_WEIGHTS = (0.35, 0.25, 0.1, 0.1, 0.1, 0.1)
# Characters per token of each style through the tiny tokenizer (20k characters each), to write a
# text of about a given number of tokens; a caller that needs the exact count counts.
CHARS_PER_TOKEN = {"prose": 2.97, "code": 1.76, "table": 1.0, "json": 1.62, "cjk": 0.36, "ids": 1.04}


def _prose(rng: np.random.Generator, n: int) -> str:
    words = _WORDS[rng.integers(0, len(_WORDS), size=n // 5 + 1)]
    return " ".join(words)[:n]


def _code(rng: np.random.Generator, n: int) -> str:
    lines: list[str] = []
    size = 0
    while size < n:
        a, b = _IDENTS[rng.integers(0, len(_IDENTS), size=2)]
        indent = "    " * int(rng.integers(0, 4))
        k = int(rng.integers(0, 4))
        line = indent + (
            f"{a}_{b} = {a}({int(rng.integers(0, 1000))}, '{b}')",
            f"if {a}[{int(rng.integers(0, 10))}] != {b}:",
            f"return {{'{a}': [{int(rng.integers(0, 100))}, {rng.random():.3f}]}}",
            f"def {a}_{b}(self, *args, **kw):",
        )[k]
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:n]


def _table(rng: np.random.Generator, n: int) -> str:
    cells = rng.random(n // 8 + 1) * 10_000
    rows = [" | ".join(f"{c:.2f}" for c in cells[i : i + 6]) for i in range(0, len(cells), 6)]
    return "\n".join(rows)[:n]


def _json(rng: np.random.Generator, n: int) -> str:
    items = []
    size = 0
    while size < n:
        a, b = _IDENTS[rng.integers(0, len(_IDENTS), size=2)]
        item = f'{{"{a}": {int(rng.integers(0, 10**6))}, "{b}": "{a}-{int(rng.integers(0, 999))}", "ok": true}}'
        items.append(item)
        size += len(item) + 2
    return ("[" + ", ".join(items) + "]")[:n]


def _cjk(rng: np.random.Generator, n: int) -> str:
    return "".join(_CJK[rng.integers(0, len(_CJK), size=n)])


def _ids(rng: np.random.Generator, n: int) -> str:
    words = ["".join(_HEX[rng.integers(0, 16, size=32)]) for _ in range(n // 33 + 1)]
    return " ".join(words)[:n]


_MAKERS = {"prose": _prose, "code": _code, "table": _table, "json": _json, "cjk": _cjk, "ids": _ids}


def chat_text(key: Sequence[int], n_chars: int, weights: Sequence[float] = DEFAULT_WEIGHTS) -> str:
    """``n_chars`` characters of mixed paragraphs (200-3,000 characters each), seeded by ``key``."""
    rng = np.random.default_rng([int(k) for k in key])
    p = np.asarray(weights, dtype=float)
    p = p / p.sum()
    parts: list[str] = []
    size = 0
    while size < n_chars:
        style = STYLES[int(rng.choice(len(STYLES), p=p))]
        k = min(n_chars - size, int(rng.integers(200, 3000)))
        parts.append(_MAKERS[style](rng, k))
        size += k + 2
    return "\n\n".join(parts)[:n_chars]


def pasted_text(key: Sequence[int], tokens: int, weights: Sequence[float] = PASTE_WEIGHTS) -> str:
    """A user's message that pastes material: a line or two of prose asking for something, then
    about ``tokens`` tokens of one kind of material (a document, a code file, a table, JSON, CJK
    text, a list of ids), seeded by ``key``.  Its first characters say little about how many
    tokens the rest holds: prose runs ~3 characters a token, CJK ~0.4 (tiny tokenizer)."""
    rng = np.random.default_rng([int(k) for k in key])
    p = np.asarray(weights, dtype=float)
    style = STYLES[int(rng.choice(len(STYLES), p=p / p.sum()))]
    ask = _prose(rng, int(rng.integers(80, 400)))
    material = _MAKERS[style](rng, max(1, round(tokens * CHARS_PER_TOKEN[style])))
    return f"{ask}:\n\n{material}"
