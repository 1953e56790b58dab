"""Which replica serves each session, and how many sessions are active per replica."""

from __future__ import annotations

from collections import OrderedDict


class SessionBook:
    """Which replica serves each session (LRU-bounded), and how many sessions are active per replica.

    A session is active for ``idle_s`` after its last request; counts are kept incrementally.
    """

    def __init__(self, max_sessions: int, idle_s: float):
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._home: OrderedDict[str, str] = OrderedDict()  # session -> replica, LRU order
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()  # by last request time
        self._active: dict[str, int] = {}

    def home(self, session: str) -> str | None:
        return self._home.get(session)

    def active(self, replica: str) -> int:
        return self._active.get(replica, 0)

    def expire(self, now: float) -> None:
        live = self._live
        while live:
            session, (replica, seen) = next(iter(live.items()))
            if seen >= now - self.idle_s:
                break
            del live[session]
            self._active[replica] -= 1

    def touch(self, session: str, replica: str, now: float) -> None:
        self._home[session] = replica
        self._home.move_to_end(session)
        if len(self._home) > self.max_sessions:
            self._home.popitem(last=False)
        old = self._live.pop(session, None)
        if old is not None:
            self._active[old[0]] -= 1
        self._live[session] = (replica, now)
        self._active[replica] = self._active.get(replica, 0) + 1

    def forget_replica(self, replica: str) -> None:
        for session in [s for s, r in self._home.items() if r == replica]:
            del self._home[session]
        for session in [s for s, (r, _) in self._live.items() if r == replica]:
            del self._live[session]
        self._active.pop(replica, None)
