"""The chat trace: a JSONL format for replaying chat traffic, generated or your own.

One JSON object per line, one request per row, in any order (rows are sorted by timestamp):

    {"timestamp": 1250, "session_id": "s-17", "messages": [{"role": "system", "content": "..."},
     {"role": "user", "content": "..."}], "max_tokens": 200}

- ``timestamp``: milliseconds (from any origin; the replay starts at the first row's);
- ``session_id``: a string, or null for a request outside any conversation; sent as the
  ``X-Session-ID`` header, which is how kvroute (and the usual routers) keep a session together;
- ``messages``: the whole OpenAI chat of that request: a conversation's later turn carries its
  history (earlier user messages and assistant replies) and its new user message, as a client
  sends it;
- ``max_tokens``: the reply's length (a positive integer).

Plain (``.jsonl``) or gzipped (``.jsonl.gz``, by the suffix).  `kvroute bench replay --chat-trace
FILE` replays one; `bench/chat_workloads.py` generates them (``--workload NAME --seed S``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatTraceError(ValueError):
    """A row that is not a chat-trace row (the message says which and why)."""


def check_row(row: Any, where: str = "row") -> dict[str, Any]:
    """The row, if it is a valid chat-trace row; else `ChatTraceError` naming the field."""
    if not isinstance(row, dict):
        raise ChatTraceError(f"{where}: not a JSON object")
    missing = [k for k in ("timestamp", "messages", "max_tokens") if k not in row]
    if missing:
        raise ChatTraceError(f"{where}: missing {', '.join(missing)}")
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts != ts:
        raise ChatTraceError(f"{where}: timestamp must be a number of milliseconds")
    sid = row.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise ChatTraceError(f"{where}: session_id must be a string or null")
    mt = row["max_tokens"]
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise ChatTraceError(f"{where}: max_tokens must be a positive integer")
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ChatTraceError(f"{where}: messages must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatTraceError(f"{where}: messages[{k}] must be {{role: {'|'.join(ROLES)}, content: string}}")
    return row


def load_chat_trace(path: str | Path) -> list[dict[str, Any]]:
    """A chat trace's rows, checked, sorted by timestamp (stable: equal timestamps keep their order)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ChatTraceError(f"{path}:{n}: not JSON ({exc})") from None
            rows.append(check_row(row, f"{path}:{n}"))
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def dump_chat_trace(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as a chat trace (gzipped if ``path`` ends in ``.gz``); returns the path."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(check_row(row), ensure_ascii=False) + "\n")
    return path


def chat_prompt_ids(rows: Sequence[dict], tokenizer_dir: Any = None) -> list[list[int]]:
    """Each chat row's prompt ids: its messages rendered with the chat template and encoded, as
    the router and vLLM do (`kvroute.common.tokens.Tokenizer`; default: the tiny tokenizer)."""
    from kvroute.replica.assets import TINY_TOKENIZER
    from kvroute.common.tokens import Tokenizer

    tok = Tokenizer.load(tokenizer_dir or TINY_TOKENIZER)
    return [tok.encode_chat(r["messages"]) for r in rows]
