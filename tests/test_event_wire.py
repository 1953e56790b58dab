"""The emulated replica's KV-event wire, without sockets: engine events -> vLLM wire events, one
batch per flush, a salted root's cache_salt in its extra_keys (docs/design.md §2.3, §4.1)."""

from __future__ import annotations

from kvroute.replica.emulated import kv_events
from kvroute.replica.emulated.event_wire import EventWire
from kvroute.replica.emulated.publisher import AllBlocksCleared, BlockRemoved, BlockStored


class FakePublisher:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events: list) -> None:
        self.batches.append(events)


def stored(hashes: list[int], parent: int | None = None) -> kv_events.BlockStored:
    return kv_events.BlockStored(hashes, parent, [7] * 4 * len(hashes), 4)


def test_a_flush_publishes_what_came_since_the_last_one_as_one_batch():
    pub = FakePublisher()
    wire = EventWire(pub, num_gpu_blocks=8)  # type: ignore[arg-type]
    wire.flush()  # nothing pending: no empty batch
    wire.on_event(stored([1, 2]))
    wire.on_event(kv_events.BlockRemoved([9]))
    wire.flush()
    wire.on_event(kv_events.AllBlocksCleared())
    wire.flush()
    assert [[type(e) for e in batch] for batch in pub.batches] == [[BlockStored, BlockRemoved], [AllBlocksCleared]]
    first = pub.batches[0][0]
    assert (first.block_hashes, first.parent_block_hash, first.medium, first.extra_keys) == ([1, 2], None, "GPU",
                                                                                          [None, None])


def test_only_a_salted_root_lists_its_salt_and_salts_are_bounded():
    pub = FakePublisher()
    wire = EventWire(pub, num_gpu_blocks=1)  # keeps the salts of 4 roots
    for root in range(4):
        wire.remember_salt(root, f"tenant-{root}")
    wire.remember_salt(0, "tenant-0")  # seen again: now the most recent
    wire.remember_salt(4, "tenant-4")  # one over the bound: the least recent (1) goes
    for root in range(5):
        wire.on_event(stored([root]))
    wire.on_event(stored([100], parent=4))  # a child block never carries the salt
    wire.flush()
    extra = [e.extra_keys[0] for e in pub.batches[0]]
    assert extra == [("tenant-0",), None, ("tenant-2",), ("tenant-3",), ("tenant-4",), None]


def test_without_a_publisher_a_flush_drops_the_batch():
    wire = EventWire(None, num_gpu_blocks=8)
    wire.on_event(stored([1]))
    wire.flush()
    pub = FakePublisher()
    wire.publisher = pub  # type: ignore[assignment]
    wire.flush()
    assert pub.batches == []
