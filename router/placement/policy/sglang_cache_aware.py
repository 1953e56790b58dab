"""SGLang's ``cache_aware`` policy, as in sglang-router 0.3.2 (``src/policies/cache_aware.rs`` and
``src/policies/tree.rs`` of the 0.3.2 sdist on PyPI).

What sglang does:
- One approximate radix tree per model over the request *text characters* (not tokens), shared by
  all workers ("tenants"): each node keeps the tenants that hold it and a last-access epoch per
  tenant.  The router never asks the engines what they cache: it records every request's text under
  the worker it picked.
- Load: ``w.load()``, the router's count of requests in flight on each worker.  Imbalanced when
  ``max - min > balance_abs_threshold`` (64) **and** ``max > min * balance_rel_threshold`` (1.5):
  then the least loaded worker is picked (first one on ties), and the text is still inserted under
  it.
- Otherwise ``prefix_match`` walks the tree: matched chars (a partial match inside an edge counts)
  over the text's chars is the match rate, and the tenant is the matched node's cached
  ``last_tenant`` (the tenant that created the node, copied on a split) if it still holds the
  node, else the first tenant listed there.  Rate ``> cache_threshold`` (0.3): that tenant.  Else,
  in 0.3.2, the least loaded healthy worker (first on ties).  The text is inserted under the
  chosen worker.  If the matched tenant is not an eligible worker, sglang drops that tenant's
  whole tree and sends the request, unrecorded, to the first healthy worker.  (Earlier
  sglang-router releases sent low-match requests to ``get_smallest_tenant()``, the worker with the
  fewest characters in the tree, and 0.3.2's header comment still says so; 0.3.2's code, and the
  issue, use the least loaded.  ``low_match="smallest_tree"`` selects the older rule.)
- Insert refreshes the epoch of the last node only; a node the tenant newly joins on the way gets
  epoch 0.  A match refreshes the matched node's epoch for the returned tenant one time in eight
  (0.3.2 does this to cut lock contention).
- A background thread every ``eviction_interval_secs`` (60 in 0.3.2's launcher) evicts, per
  tenant whose character count exceeds ``max_tree_size`` (2**26), that tenant's least recently used
  leaves until it fits.  The bound is in characters per tenant, whatever the engine's KV capacity.

Deviations (small; the rule itself is unchanged):
- Eviction runs inside ``choose`` once ``req.now`` has passed the next due time, on the caller's
  clock (virtual time in the simulator) instead of a wall-clock thread; a pass that would evict
  nothing (every tenant within budget) skips the tree walk.
- Epochs come from a per-tree counter (sglang: one process-wide atomic counter); ties among equal
  epochs pop in insertion order.
- Tenants are listed in insertion order where sglang's DashMap order is arbitrary.
- Load figures cover the eligible replicas passed in; sglang's max/min also count unhealthy
  workers.
- ``Choice.matched_blocks`` (what the policy believed the chosen replica held) converts the
  tree's character match for the chosen tenant to blocks: matched share of the text times the
  prompt's tokens, in whole blocks (exact with the simulator's one character per token).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 60.0
MAX_TREE_SIZE = 2**26  # characters per tenant


def shared_prefix_len(text: str, start: int, edge: str) -> int:
    """Length of the common prefix of ``text[start:]`` and ``edge``, compared in C."""
    hi = min(len(edge), len(text) - start)
    if text.startswith(edge[:hi], start):
        return hi
    lo = 0  # invariant: the first ``lo`` chars match, the first ``hi`` do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("text", "children", "tenants", "parent", "last_tenant")

    def __init__(self, text: str, parent: _Node | None, last_tenant: str | None = None):
        self.text = text
        self.children: dict[str, _Node] = {}  # first char of the child's edge -> child
        self.tenants: dict[str, int] = {}  # tenant -> last access epoch
        self.parent = parent
        self.last_tenant = last_tenant


class ApproxRadixTree:
    """sglang's multi-tenant approximate radix tree over characters, with edge compression."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.tenant_chars: dict[str, int] = {}
        self._epochs = itertools.count()

    def insert(self, text: str, tenant: str) -> None:
        self.root.tenants.setdefault(tenant, 0)  # the root is never evicted
        counts = self.tenant_chars
        counts.setdefault(tenant, 0)
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, tenant)
                leaf.tenants[tenant] = next(self._epochs)
                node.children[text[i]] = leaf
                counts[tenant] += n - i
                return
            edge = child.text
            if text.startswith(edge, i):
                shared = len(edge)
            else:
                shared = shared_prefix_len(text, i, edge)
                mid = _Node(edge[:shared], node, child.last_tenant)
                mid.tenants = dict(child.tenants)
                mid.children[edge[shared]] = child
                node.children[text[i]] = mid
                child.text = edge[shared:]
                child.parent = mid
                child = mid
            if tenant not in child.tenants:
                counts[tenant] += shared
                child.tenants[tenant] = 0
            node, i = child, i + shared
        node.tenants[tenant] = next(self._epochs)

    def prefix_match(self, text: str) -> tuple[int, str | None]:
        """(matched characters, tenant of the deepest matched node); tenant None if the tree is empty."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            edge = child.text
            node = child
            if text.startswith(edge, i):
                i += len(edge)
            else:
                i += shared_prefix_len(text, i, edge)
                break
        tenant = node.last_tenant
        if tenant is None or tenant not in node.tenants:
            tenant = next(iter(node.tenants), None)
            node.last_tenant = tenant
        epoch = next(self._epochs)
        if tenant is not None and epoch & 0x7 == 0:
            node.tenants[tenant] = epoch
        return i, tenant

    def matched_chars(self, text: str, tenant: str) -> int:
        """Leading characters of ``text`` the tree holds for ``tenant`` (read-only, no epoch update)."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None or tenant not in child.tenants:
                break
            edge = child.text
            if not text.startswith(edge, i):
                return i + shared_prefix_len(text, i, edge)
            node, i = child, i + len(edge)
        return i

    def _nodes(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    @staticmethod
    def _is_leaf_for(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def _drop(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        parent = node.parent
        if parent is not None and not node.children and not node.tenants:
            parent.children.pop(node.text[0], None)

    def evict_tenant_by_size(self, max_size: int) -> None:
        counts = self.tenant_chars
        if all(c <= max_size for c in counts.values()):
            return
        seq = itertools.count()  # heap tiebreak: nodes are not comparable
        heap: list[tuple[int, int, str, _Node]] = []
        for node in self._nodes():
            for tenant, epoch in node.tenants.items():
                if self._is_leaf_for(node, tenant):
                    heap.append((epoch, next(seq), tenant, node))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if counts.get(tenant, 0) <= max_size or node is self.root:
                continue
            if not self._is_leaf_for(node, tenant):
                continue
            counts[tenant] = max(0, counts[tenant] - len(node.text))
            self._drop(node, tenant)
            parent = node.parent
            if parent is not None and self._is_leaf_for(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(seq), tenant, parent))

    def remove_tenant(self, tenant: str) -> None:
        # Children before parents, so emptied subtrees are pruned bottom-up.
        for node in reversed(list(self._nodes())):
            if tenant in node.tenants:
                if node is self.root:
                    del node.tenants[tenant]
                else:
                    self._drop(node, tenant)
        self.tenant_chars.pop(tenant, None)


class SglangCacheAwarePolicy(Policy):
    name = "sglang_cache_aware"
    needs_text = True
    reasons = ("cache", "load", "balance", "fallback")

    def __init__(
        self,
        *,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        eviction_interval_s: float = EVICTION_INTERVAL_S,
        max_tree_size: int = MAX_TREE_SIZE,
        low_match: str = "least_loaded",
        seed: int = 0,
    ):
        if low_match not in ("least_loaded", "smallest_tree"):
            raise ValueError("low_match must be 'least_loaded' (sglang 0.3.2) or 'smallest_tree'")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.low_match = low_match
        self.tree = ApproxRadixTree()
        self._next_eviction: float | None = None

    def _maybe_evict(self, now: float) -> None:
        if self.eviction_interval_s <= 0:
            return
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            self.tree.evict_tenant_by_size(self.max_tree_size)
            self._next_eviction = now + self.eviction_interval_s

    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        self._maybe_evict(req.now)
        for r in replicas:  # sglang's init_workers inserts "" for every worker
            if r.name not in self.tree.tenant_chars:
                self.tree.insert("", r.name)
        text = req.text
        least = min(replicas, key=lambda r: r.in_flight)  # min_by_key: first on ties
        hi = max(r.in_flight for r in replicas)
        lo = least.in_flight
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            pick, reason = least, "balance"
        else:
            matched, tenant = self.tree.prefix_match(text)
            rate = matched / len(text) if text else 0.0
            by_name = {r.name: r for r in replicas}
            if rate > self.cache_threshold and tenant in by_name:
                pick, reason = by_name[tenant], "cache"
            elif rate > self.cache_threshold and tenant is not None:
                # sglang: the matched worker is gone or unhealthy -> drop its whole tree and fall
                # back to the first healthy worker, without recording the request.
                self.tree.remove_tenant(tenant)
                pick = replicas[0]
                return Choice(pick.name, "fallback", self._believed_blocks(req, pick.name))
            elif self.low_match == "smallest_tree":
                sizes = self.tree.tenant_chars
                pick = min(replicas, key=lambda r: sizes.get(r.name, 0))
                reason = "load"
            else:
                pick, reason = least, "load"
        believed = self._believed_blocks(req, pick.name)
        self.tree.insert(text, pick.name)
        return Choice(pick.name, reason, believed)

    def _believed_blocks(self, req: Query, tenant: str) -> int:
        """The tree's belief for ``tenant`` in blocks: its share of the text, applied to the tokens."""
        text = req.text
        if not text or req.block_size <= 0:
            return 0
        chars = self.tree.matched_chars(text, tenant)
        blocks = int(chars / len(text) * req.prompt_tokens) // req.block_size
        return min(blocks, len(req.chain))

    def forget_replica(self, replica: str) -> None:
        self.tree.remove_tenant(replica)
