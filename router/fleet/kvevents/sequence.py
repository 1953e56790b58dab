"""A KV-event publisher's batch numbering, as plain state: no sockets, no index, no waiting.

vLLM numbers its batches from 0 in each process.  The stream asks this tracker what a batch is:
the next one (apply it), one applied already (a replay overlapping the live socket: skip it),
one past a gap (replay what is missing), or proof of a new process (its numbering went back, or
a number came again with other contents: the replica restarted and its cache is empty):
docs/design.md §4.2.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

DIGEST_WINDOW = 4096  # digests of the last batches applied, to tell a replay's overlap from a restart

Verdict = Literal["apply", "applied", "gap", "changed"]


class BatchSequence:
    def __init__(self, window: int = DIGEST_WINDOW) -> None:
        self.window = window
        self.next: int | None = None  # seq expected next; None: unknown, take what comes
        self.last_live: int | None = None  # last seq read off the live socket
        self._digests: OrderedDict[int, int] = OrderedDict()

    def went_back(self, seq: int) -> bool:
        """A live ``seq`` not after the last live one: the publisher counts from 0 again."""
        return self.last_live is not None and seq <= self.last_live

    def classify(self, seq: int, digest: int) -> Verdict:
        """What batch ``seq`` (contents ``digest``) is, against what was applied."""
        if self.next is None or seq == self.next:
            return "apply"
        if seq > self.next:
            return "gap"
        applied = self._digests.get(seq)
        return "applied" if applied is None or applied == digest else "changed"

    def applied(self, seq: int, digest: int) -> None:
        digests = self._digests
        digests[seq] = digest
        if len(digests) > self.window:
            digests.popitem(last=False)
        self.next = seq + 1

    def digest(self, seq: int) -> int | None:
        """The contents of an applied batch, while it is in the window."""
        return self._digests.get(seq)

    def forget_position(self) -> None:
        """Take the next batch that comes, whatever its number (after a loss, or to re-apply
        a whole history); the digests stay, to recognise the same process."""
        self.next = None

    def reset(self) -> None:
        """A new process: forget its numbering entirely."""
        self.next = None
        self.last_live = None
        self._digests.clear()
