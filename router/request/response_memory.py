"""The router's memory of the Responses API conversations it relayed (common/responses.py).

A stored response lives on the replica that produced it (vLLM keeps it in that process's memory),
so ``previous_response_id`` pins the request to that replica while it is eligible, and the
conversation's first response id is its session key.  :class:`ResponseMemory` remembers, per
response id the router relayed, the replica, the session and what the next turn's rendering needs
(the request's new messages and the output texts), LRU within a character budget; an id it does
not know (another router, a restart, evicted) is routed by cache affinity like any chat, and the
part of the prompt it cannot see is not hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvroute.common.responses import ResponsesParsed, chat_messages, input_messages, output_texts


@dataclass(slots=True)
class _Turn:
    replica: str
    session: str
    parent: str | None  # the previous_response_id this response continued
    instructions: str | None
    inputs: list[dict[str, Any]]
    outputs: list[str]
    chars: int


class ResponseMemory:
    """Response id -> replica, session and the pieces of its conversation (LRU, ``max_chars``)."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.chars = 0
        self._turns: OrderedDict[str, _Turn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def prepare(self, parsed: ResponsesParsed) -> tuple[str | None, str | None]:
        """Fill ``parsed.render``; (session key, replica to pin to) from ``previous_response_id``."""
        body = parsed.body
        prev = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        session = pin = None
        if prev is not None:
            turn = self._turns.get(prev)
            if turn is None:
                session = prev  # unknown here: the conversation still gets a stable key from now on
            else:
                self._turns.move_to_end(prev)
                session, pin = turn.session, turn.replica
                history = self.history(prev) or []
        parsed.render = {"messages": chat_messages(body.get("instructions"), history, input_messages(body))}
        return session, pin

    def history(self, response_id: str) -> list[dict[str, Any]] | None:
        """What vLLM stored for ``response_id`` plus its outputs: the messages a request continuing it
        starts with (after its own instructions).  None if a turn of the chain was forgotten."""
        chain = []
        at: str | None = response_id
        while at is not None:
            turn = self._turns.get(at)
            if turn is None:
                return None
            chain.append(turn)
            at = turn.parent
        messages: list[dict[str, Any]] = []
        for turn in reversed(chain):  # the first response first
            messages = chat_messages(turn.instructions, messages, turn.inputs)
            messages += [{"role": "assistant", "content": text} for text in turn.outputs]
        return messages

    def remember(self, parsed: ResponsesParsed, replica: str, response: Any, session: str | None) -> None:
        """A response the replica produced (its JSON object, whole or from ``response.completed``)."""
        if not isinstance(response, dict) or not isinstance(response.get("id"), str):
            return
        rid = response["id"]
        body = parsed.body
        outputs = output_texts(response)
        chars = len(parsed.raw) + sum(map(len, outputs)) + 200
        if chars > self.max_chars:
            return
        old = self._turns.pop(rid, None)
        if old is not None:
            self.chars -= old.chars
        self._turns[rid] = _Turn(replica, session or rid, body.get("previous_response_id"), body.get("instructions"),
                                 input_messages(body), outputs, chars)
        self.chars += chars
        while self.chars > self.max_chars:
            _, evicted = self._turns.popitem(last=False)
            self.chars -= evicted.chars

    def forget_replica(self, replica: str) -> None:
        """A replica left: what it stored is gone with it."""
        for rid in [rid for rid, turn in self._turns.items() if turn.replica == replica]:
            self.chars -= self._turns.pop(rid).chars

    def replica_of(self, response_id: str) -> str | None:
        """The replica that stored ``response_id``, if this process relayed it (and still remembers)."""
        turn = self._turns.get(response_id)
        return turn.replica if turn is not None else None
