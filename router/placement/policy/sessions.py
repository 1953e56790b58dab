"""Which replica serves each session, how many sessions are active per replica, and how many
turns a session has left."""

from __future__ import annotations

from collections import Counter, OrderedDict

# Until enough sessions have ended, a session is expected to have this many turns after the
# current one, counted as PRIOR_SESSIONS ended sessions would count.
PRIOR_TURNS_LEFT = 2.0
PRIOR_SESSIONS = 10


class SessionBook:
    """Which replica serves each session (LRU-bounded), and how many sessions are active per replica.

    A session is active for ``idle_s`` after its last request; counts are kept incrementally.  An
    active session counts its turns; when it goes idle its length joins the lengths of ended
    sessions, from which :meth:`turns_left` estimates how many turns an active one has left.
    """

    def __init__(self, max_sessions: int, idle_s: float):
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._home: OrderedDict[str, str] = OrderedDict()  # session -> replica, LRU order
        self._live: OrderedDict[str, tuple[str, float, int]] = OrderedDict()  # (replica, last request, turns)
        self._active: dict[str, int] = {}
        self._lengths: Counter[int] = Counter()  # turns of ended sessions

    def home(self, session: str) -> str | None:
        return self._home.get(session)

    def active(self, replica: str) -> int:
        return self._active.get(replica, 0)

    def expire(self, now: float) -> None:
        live = self._live
        while live:
            session, (replica, seen, turns) = next(iter(live.items()))
            if seen >= now - self.idle_s:
                break
            del live[session]
            self._active[replica] -= 1
            self._lengths[turns] += 1

    def turns(self, session: str) -> int:
        """Requests the active ``session`` has made (0 if it is not active)."""
        entry = self._live.get(session)
        return entry[2] if entry is not None else 0

    def turns_left(self, turns: int) -> float:
        """Expected turns after the next one of a session that has made ``turns``: the mean over
        ended sessions that got that far, blended with a prior while few have ended."""
        longer = [(n, k) for n, k in self._lengths.items() if n > turns]
        count = sum(k for _, k in longer)
        left = sum((n - turns - 1) * k for n, k in longer)
        return (PRIOR_TURNS_LEFT * PRIOR_SESSIONS + left) / (PRIOR_SESSIONS + count)

    def touch(self, session: str, replica: str, now: float) -> None:
        self._home[session] = replica
        self._home.move_to_end(session)
        if len(self._home) > self.max_sessions:
            self._home.popitem(last=False)
        old = self._live.pop(session, None)
        if old is not None:
            self._active[old[0]] -= 1
        self._live[session] = (replica, now, old[2] + 1 if old is not None else 1)
        self._active[replica] = self._active.get(replica, 0) + 1

    def forget_replica(self, replica: str) -> None:
        for session in [s for s, r in self._home.items() if r == replica]:
            del self._home[session]
        for session in [s for s, (r, _, _) in self._live.items() if r == replica]:
            del self._live[session]
        self._active.pop(replica, None)
