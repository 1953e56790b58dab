"""Late binding in the fleet simulator: hold a request at the router while every replica is past a
room threshold, place it when one has room (issue 20 item 4; docs/experiments.md says what it
measured).

``Room`` is the rule: a replica has room when each signal given is at or under its threshold:
vLLM's ``num_requests_waiting`` (the engine's own queue: work sent beyond what its scheduler
admitted), the router's estimated prefill queue (its queued uncached tokens over the learned
prefill rate, seconds) and the router's in-flight count.  ``HoldingSim`` is the simulator with
the hold: an arrival that finds no replica with room (or others already held: arrival order) waits
in a FIFO; at every tick the head is placed, through the same ``Placement``, as soon as a replica
has room, or when it has waited ``hold_max_s`` (never refused, never lost).  With ``room_only``
the policy chooses among the replicas with room only; otherwise among all, at the moment of
release (late binding: the load and the caches then, not at arrival).  The engines are read at
every tick (fresher than a live router's one-second scrape): the hold's best case.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sim import FleetConfig, FleetSim, PreparedWorkload, RunResult

TICK_S = 0.005  # engine seconds between room checks while requests are held (steps take 10-50 ms)


@dataclass(frozen=True)
class Room:
    """When a replica has room for one more request (None: that signal is not used)."""

    max_waiting: int | None = 0  # vLLM's num_requests_waiting at most this
    max_queue_s: float | None = None  # the router's queued prefill tokens / learned rate, seconds
    max_in_flight: int | None = None  # the router's own in-flight count
    hold_max_s: float = 1.0  # engine seconds a request may be held before it is placed anyway
    room_only: bool = False  # release among the replicas with room only
    # "fifo": hold while no replica has room, release in arrival order to the policy's pick among all;
    # "choice": ask the policy at once, hold only if its pick has no room; when the pick has room
    # (per replica in arrival order) or the budget is spent, ask again and send: each request
    # waits for its own best replica, and is placed by the state at that moment
    release: str = "fifo"

    max_queued_tokens: int | None = None  # the router's queued uncached prompt tokens (first token not back)
    scrape_s: float = 0.0  # the engines' waiting count as of the last scrape this often (0: read fresh)

    def has_room(self, waiting: int, load: Any) -> bool:
        if self.max_waiting is not None and waiting > self.max_waiting:
            return False
        if self.max_queued_tokens is not None and load.queued_prefill_tokens > self.max_queued_tokens:
            return False
        if self.max_in_flight is not None and load.in_flight > self.max_in_flight:
            return False
        if self.max_queue_s is not None and load.queued_prefill_tokens / max(load.prefill_rate, 1.0) > self.max_queue_s:
            return False
        return True

    def label(self) -> str:
        parts = [f"tokens<={self.max_queued_tokens}" if self.max_queued_tokens is not None else "",
                 f"scrape {self.scrape_s:g}s" if self.scrape_s else "",
                 f"w<={self.max_waiting}" if self.max_waiting is not None else "",
                 f"q<={self.max_queue_s:g}s" if self.max_queue_s is not None else "",
                 f"f<={self.max_in_flight}" if self.max_in_flight is not None else "",
                 f"max {self.hold_max_s:g}s", "room-only" if self.room_only else "",
                 "by choice" if self.release == "choice" else ""]
        return "hold(" + ", ".join(p for p in parts if p) + ")"


@dataclass
class HoldStats:
    held: int = 0  # requests that waited at the router
    waits: list[float] = field(default_factory=list)  # engine seconds each held request waited
    expired: int = 0  # placed because their budget ran out, not because a replica had room


class HoldingSim(FleetSim):
    def __init__(self, prepared: PreparedWorkload, policy: Any, cfg: FleetConfig, room: Room):
        super().__init__(prepared, policy, cfg)
        self.room = room
        self.held: deque[tuple[float, int]] = deque()  # (arrival, request index), arrival order
        self.stats = HoldStats()
        self._scraped: list[int] = [0] * len(self.engines)
        self._scraped_at = -math.inf
        self._pick: dict[int, str] = {}  # held request -> the replica the policy picked at arrival
        self._waited_for: set[str] = set()  # replicas that held requests wait for (release by choice)

    def _waiting(self, k: int) -> int:
        """Replica ``k``'s waiting count as the router knows it: fresh, or as of the last scrape."""
        if not self.room.scrape_s:
            return self.engines[k].num_waiting
        if self.now >= self._scraped_at + self.room.scrape_s:
            self._scraped = [e.num_waiting for e in self.engines]
            self._scraped_at = self.now - (self.now % self.room.scrape_s)
        return self._scraped[k]

    def _with_room(self) -> list[int]:
        return [k for k, name in enumerate(self.names) if self.room.has_room(self._waiting(k), self.tracker.state(name))]

    def _arrive(self, i: int, arrival: float) -> None:
        if self.room.release == "choice":
            self._release()  # those held for a replica go first
            query, choice = self._decide(i)
            if self._room_at(choice.replica) and choice.replica not in self._waited_for:
                self._send(i, arrival, query, choice)
                return
            self._pick[i] = choice.replica
        elif not self.held and self._with_room():
            self._route(i, arrival)
            return
        self.held.append((arrival, i))
        self.stats.held += 1
        self._release()

    def _on_tick(self) -> None:
        self._release()

    def _room_at(self, name: str) -> bool:
        return self.room.has_room(self._waiting(self._replica_pos[name]), self.tracker.state(name))

    def _release(self) -> None:
        if self.room.release == "choice":
            self._release_by_choice()
            return
        while self.held:
            arrival, i = self.held[0]
            room = self._with_room()
            overdue = self.now - arrival >= self.room.hold_max_s - 1e-9
            if not room and not overdue:
                return
            self.held.popleft()
            self.stats.waits.append(self.now - arrival)
            if not room:
                self.stats.expired += 1
            self._route(i, arrival, room if (room and self.room.room_only) else None)

    def _release_by_choice(self) -> None:
        """In arrival order, a held request whose pick has room (no earlier one still waiting for
        it) is decided again, now, and sent where that decision says; one past its budget too.
        The policy is asked twice per held request, never at every tick: ``choose`` keeps
        counters (cost_model's decision count, its starvation window) that polling would skew."""
        still: deque[tuple[float, int]] = deque()
        self._waited_for = set()
        for arrival, i in self.held:
            pick = self._pick[i]
            fits = self._room_at(pick) and pick not in self._waited_for
            if fits or self.now - arrival >= self.room.hold_max_s - 1e-9:
                self.stats.waits.append(self.now - arrival)
                self.stats.expired += not fits
                del self._pick[i]
                self._route(i, arrival)
            else:
                self._waited_for.add(pick)
                still.append((arrival, i))
        self.held = still

    def _wake_at(self) -> float:
        if not self.held:
            return math.inf
        return min(self.now + TICK_S, self.held[0][0] + self.room.hold_max_s)


def simulate_held(prepared: PreparedWorkload, policy: Any, cfg: FleetConfig, room: Room | None) -> tuple[RunResult, HoldStats]:
    """One run: with the hold (``room``) or, with None, the plain simulator."""
    if room is None:
        sim = FleetSim(prepared, policy, cfg)
        return sim.simulate(), HoldStats()
    held = HoldingSim(prepared, policy, cfg, room)
    return held.simulate(), held.stats


def wait_summary(stats: HoldStats) -> dict[str, float]:
    w = np.array(stats.waits) if stats.waits else np.zeros(1)
    return {"held": stats.held, "expired": stats.expired, "wait_mean_s": float(w.mean()), "wait_max_s": float(w.max())}
