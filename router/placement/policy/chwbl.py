"""Consistent hashing with bounded loads (CHWBL), as KubeAI's ``PrefixHash`` strategy (docs/design.md §5.5).

What KubeAI does (``internal/loadbalancer/balance_chwbl.go``, ``group.go``, ``api/k8s/v1``):
- Each endpoint sits on a hash ring ``replication`` times (default 256): the point of copy ``i``
  is ``xxhash64(name + str(i))``.  A request's key is hashed with the same xxhash64.
- The walk starts at the first point >= the key's hash (wrapping) and goes clockwise over ring
  points; the first endpoint whose load is acceptable wins.  If none is, the first endpoint met
  is used anyway.
- Acceptable means ``load <= (total_in_flight + 1) / n_endpoints * load_factor`` (the ``+1``
  counts the new request; ``load`` is the endpoint's current in-flight count, without it), and
  anything is acceptable while the total is 0.  ``load_factor`` is ``meanLoadFactor`` / 100,
  default 125 -> 1.25.
- The key is the LoRA adapter name + the first ``prefixCharLength`` (default 100) characters of
  the first user message (completions: of the prompt).  KubeAI has no session key.

Deliberate deviations:
- Key: the request's session key when it has one (``X-Session-ID`` / ``user``), else the first
  block hash of the prompt, which already folds in model, adapter and cache_salt (the namespace
  seed) and the first ``block_size`` tokens.  The issue asks for this; it differs from KubeAI,
  whose key skips the system prompt and looks at the first user message's text.
- A prompt shorter than one block has no key: it goes round-robin (KubeAI would hash the adapter
  name alone, which sends every such request to one ring point).
- ``n`` and the total load are taken over the eligible replicas passed in (KubeAI's group holds
  exactly its ready endpoints, so this is the same thing).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import xxhash

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query

DEFAULT_REPLICATION = 256  # KubeAI's ``replication`` default
DEFAULT_LOAD_FACTOR = 1.25  # KubeAI's ``meanLoadFactor`` default, 125 %


def ring_hash(s: str) -> int:
    """xxhash64, seed 0: what KubeAI's ``cespare/xxhash.Sum64`` computes."""
    return xxhash.xxh64_intdigest(s.encode())


def load_ok(load: int, total_load: int, n: int, load_factor: float) -> bool:
    """KubeAI's ``chwblLoadOK``."""
    if total_load == 0:
        return True
    return load <= (total_load + 1) / n * load_factor


class _Ring:
    def __init__(self, names: frozenset[str], replication: int):
        points = sorted((ring_hash(f"{name}{i}"), name) for name in names for i in range(replication))
        self.hashes = [h for h, _ in points]
        self.owners = [name for _, name in points]

    def walk(self, key_hash: int) -> int:
        """Index of the first ring point at or after ``key_hash`` (wrapping)."""
        i = bisect.bisect_left(self.hashes, key_hash)
        return 0 if i >= len(self.hashes) else i


class ChwblPolicy(Policy):
    name = "chwbl"
    reasons = ("hash", "balance", "round_robin")

    def __init__(
        self,
        *,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        replication: int = DEFAULT_REPLICATION,
        seed: int = 0,
    ):
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (KubeAI: meanLoadFactor >= 100)")
        if replication < 1:
            raise ValueError("replication must be >= 1")
        self.load_factor = load_factor
        self.replication = replication
        self._ring: _Ring | None = None
        self._ring_names: frozenset[str] = frozenset()
        self._rr = 0  # for keyless requests

    @staticmethod
    def key_of(req: Query) -> str | None:
        if req.session_key:
            return req.session_key
        if req.chain:
            return f"{req.chain[0]:x}"
        return None

    def _ring_for(self, replicas: Sequence[ReplicaState]) -> _Ring:
        names = frozenset(r.name for r in replicas)
        if self._ring is None or names != self._ring_names:
            # The fleet changes rarely; rebuilding (sorting n * replication points) is cheap then.
            self._ring = _Ring(names, self.replication)
            self._ring_names = names
        return self._ring

    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        if len(replicas) == 1:
            return Choice(replicas[0].name, "hash", req.matches.get(replicas[0].name, 0))
        key = self.key_of(req)
        if key is None:
            pick = replicas[self._rr % len(replicas)]
            self._rr += 1
            return Choice(pick.name, "round_robin", req.matches.get(pick.name, 0))

        ring = self._ring_for(replicas)
        by_name = {r.name: r for r in replicas}
        total = sum(r.in_flight for r in replicas)
        n = len(replicas)
        start = ring.walk(ring_hash(key))
        first = ring.owners[start]
        points = len(ring.owners)
        for step in range(points):
            owner = ring.owners[(start + step) % points]
            if load_ok(by_name[owner].in_flight, total, n, self.load_factor):
                reason = "hash" if owner == first else "balance"
                return Choice(owner, reason, req.matches.get(owner, 0))
        # Unreachable for load_factor >= 1 (the least loaded replica is always acceptable), but
        # KubeAI falls back to the first endpoint met, and so do we.
        return Choice(first, "hash", req.matches.get(first, 0))
