"""The replica's KV-event wire: the engine's events (``kv_events``) turned into vLLM's wire events
(``publisher``) and published as one batch per engine step, as vLLM publishes.

vLLM lists a salted chain's ``cache_salt`` in the ``extra_keys`` of the chain's first block, so the
wire remembers the salt of each salted root it was told about (``remember_salt``).
"""

from __future__ import annotations

from typing import Any

from . import kv_events
from kvroute.replica.emulated.publisher import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher, WireEvent


class EventWire:
    """Collects one step's events (``on_event``, the engine's callback) and publishes them as one
    batch on ``flush``; without a publisher, a flush drops them."""

    def __init__(self, publisher: KVEventPublisher | None, num_gpu_blocks: int):
        self.publisher = publisher
        self._pending: list[WireEvent] = []
        self._salt_of_root: dict[int, str] = {}
        self._max_salts = 4 * num_gpu_blocks  # a bound: roots outlive no more than the cache

    def on_event(self, event: kv_events.KVEvent) -> None:
        self._pending.append(self._to_wire(event))

    def remember_salt(self, root: int, salt: str) -> None:
        salts = self._salt_of_root
        salts.pop(root, None)
        salts[root] = salt
        while len(salts) > self._max_salts:
            del salts[next(iter(salts))]

    def flush(self) -> None:
        """Publish what the engine emitted since the last flush as one batch (one step's worth)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        if self.publisher is not None:
            self.publisher.publish(events)

    def _to_wire(self, event: kv_events.KVEvent) -> WireEvent:
        if isinstance(event, kv_events.BlockStored):
            extra: list[tuple[Any, ...] | None] = [None] * len(event.block_hashes)
            if event.parent_block_hash is None and event.block_hashes:
                salt = self._salt_of_root.get(event.block_hashes[0])
                if salt is not None:
                    extra[0] = (salt,)
            return BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                               token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                               medium=MEDIUM_GPU, lora_name=None, extra_keys=extra, group_idx=0,
                               kv_cache_spec_kind="full_attention")
        if isinstance(event, kv_events.BlockRemoved):
            return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU, group_idx=0)
        return AllBlocksCleared()
