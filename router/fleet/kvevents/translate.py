"""From a replica's KV events to the router's own block hashes (docs/design.md §2.3).

The router hashes each stored block's tokens itself, chained from its parent's *router* hash,
found in a per-replica map engine hash → router hash; a chain's first block starts from the
namespace seed (the replica's model, the event's LoRA name, the ``cache_salt`` in ``extra_keys``).

What cannot be matched is skipped and counted (``kvroute_kv_events_skipped_total{reason}``) rather
than confirmed under a wrong hash:
- ``block_size``: the engine's block size is not the one the router hashes this model with;
- ``token_count``: the tokens do not fill the blocks (vLLM sends ``[]`` in some snapshots);
- ``unknown_parent``: the parent was never seen (history lost, or it was skipped itself);
- ``extra_keys``: multimodal or prompt-embedding keys entered the hash, which text hashing
  cannot reproduce (two images behind the same placeholder tokens must not share a chain);
- ``lora_unknown``: a legacy event names a LoRA slot (``lora_id``) but not the adapter;
- ``medium``: blocks on another medium than the GPU (offloaded copies are not prefix hits);
- ``group``: a KV-cache group that is not full attention (a sliding window drops old blocks
  that the full-attention group still holds);
- ``unknown_removed``: a removed block the map does not know (it was skipped when stored).

The map is an LRU bounded near the replica's KV capacity: BlockRemoved keeps it to what the
engine holds, and the bound covers removals lost with a gap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvroute.common.blocks import chain_from_bytes, namespace_seed, token_bytes

from kvroute.router.fleet.kvevents.wire import BlockRemoved, BlockStored, EngineHash

SKIP_REASONS = (
    "block_size",
    "token_count",
    "unknown_parent",
    "extra_keys",
    "lora_unknown",
    "medium",
    "group",
    "unknown_removed",
    "undecodable",  # events (not blocks) the wire decoder could not read
    "bad_frame",  # messages (not events) that were not KV-event frames
)
GPU_MEDIA = (None, "GPU")
FULL_ATTENTION_KINDS = (None, "full_attention")

Skip = Callable[[str, int], None]


def map_capacity(capacity_blocks: int) -> int:
    """The map's bound: the replica's capacity plus slack for removals lost with a gap."""
    return capacity_blocks + max(capacity_blocks // 4, 256)


class ChainTranslator:
    """One replica's engine → router hash map, and the translation of its events."""

    def __init__(self, model: str, capacity_blocks: int) -> None:
        self.model = model
        self.capacity = map_capacity(capacity_blocks)
        self._router_of: OrderedDict[EngineHash, int] = OrderedDict()
        self._seeds: dict[tuple[str | None, str | None], int] = {}
        self._partial_groups: set[int] = set()  # group indexes learned not to be full attention

    def __len__(self) -> int:
        return len(self._router_of)

    def router_hash(self, engine_hash: EngineHash) -> int | None:
        return self._router_of.get(engine_hash)

    def clear(self) -> None:
        """AllBlocksCleared or a restart: the engine holds nothing any more."""
        self._router_of.clear()
        self._partial_groups.clear()

    def stored(self, ev: BlockStored, block_size: int, skip: Skip) -> list[int]:
        """Router hashes of the blocks to confirm (a prefix of the event's blocks)."""
        n = len(ev.block_hashes)
        if n == 0:
            return []
        if ev.medium not in GPU_MEDIA:
            skip("medium", n)
            return []
        if ev.kv_cache_spec_kind not in FULL_ATTENTION_KINDS:
            if ev.group_idx is not None:
                self._partial_groups.add(ev.group_idx)
            skip("group", n)
            return []
        if ev.block_size != block_size:
            skip("block_size", n)
            return []
        if len(ev.token_ids) != n * block_size:
            skip("token_count", n)
            return []
        if ev.lora_name is None and ev.lora_id is not None:
            skip("lora_unknown", n)
            return []
        extra = ev.extra_keys
        if extra is not None and len(extra) != n:
            skip("extra_keys", n)
            return []
        routable = n
        if ev.parent_block_hash is None:
            salt = self._root_salt(extra[0] if extra else None, ev.lora_name)
            if salt is False:
                skip("extra_keys", n)
                return []
            parent = self._seed(ev.lora_name, salt)  # type: ignore[arg-type]
            first_plain = 1
        else:
            found = self._router_of.get(ev.parent_block_hash)
            if found is None:
                skip("unknown_parent", n)
                return []
            self._router_of.move_to_end(ev.parent_block_hash)
            parent = found
            first_plain = 0
        if extra is not None:
            for i in range(first_plain, n):
                if not _plain(extra[i], ev.lora_name):
                    routable = i  # this block's hash has keys text cannot reproduce: stop here
                    break
        tokens = ev.token_ids if routable == n else ev.token_ids[: routable * block_size]
        hashes = chain_from_bytes(token_bytes(tokens), block_size, parent)
        router_of = self._router_of
        for engine_hash, router_hash in zip(ev.block_hashes, hashes):
            router_of[engine_hash] = router_hash
            router_of.move_to_end(engine_hash)
        while len(router_of) > self.capacity:
            router_of.popitem(last=False)
        if routable < n:
            skip("extra_keys", n - routable)  # and their descendants, later, as unknown_parent
        return hashes

    def removed(self, ev: BlockRemoved, skip: Skip) -> list[int]:
        """Router hashes of the removed blocks the map knew (and forgets now)."""
        n = len(ev.block_hashes)
        if ev.medium not in GPU_MEDIA:
            skip("medium", n)
            return []
        if ev.group_idx is not None and ev.group_idx in self._partial_groups:
            skip("group", n)
            return []
        pop = self._router_of.pop
        out = []
        for engine_hash in ev.block_hashes:
            router_hash = pop(engine_hash, None)
            if router_hash is not None:
                out.append(router_hash)
        if len(out) < n:
            skip("unknown_removed", n - len(out))
        return out

    def _seed(self, lora: str | None, salt: str | None) -> int:
        key = (lora, salt)
        seed = self._seeds.get(key)
        if seed is None:
            if len(self._seeds) > 4096:  # one per (adapter, tenant): bounded all the same
                self._seeds.clear()
            seed = self._seeds[key] = namespace_seed(self.model, lora, salt)
        return seed

    @staticmethod
    def _root_salt(keys: Sequence[Any] | None, lora: str | None) -> str | None | bool:
        """The cache_salt of a chain's first block, None if unsalted, False if unroutable.

        vLLM orders a block's extra keys LoRA name, multimodal hashes, cache_salt (first block
        only), prompt-embedding hashes: after the LoRA name, a text prompt leaves at most the salt.
        """
        if not keys:
            return None
        rest = list(keys)
        if lora is not None and rest and rest[0] == lora:
            rest = rest[1:]
        if not rest:
            return None
        if len(rest) == 1 and isinstance(rest[0], str):
            return rest[0]
        return False


def _plain(keys: Sequence[Any] | None, lora: str | None) -> bool:
    """A non-first block whose hash took nothing but its tokens (and its LoRA name)."""
    return not keys or (lora is not None and len(keys) == 1 and keys[0] == lora)


__all__ = ["SKIP_REASONS", "ChainTranslator", "map_capacity"]
