"""The KV-event batch numbering on its own (router/fleet/kvevents/sequence.py): no sockets needed."""

from kvroute.router.fleet.kvevents.sequence import BatchSequence


def test_a_fresh_sequence_takes_whatever_comes_then_expects_the_next():
    s = BatchSequence()
    assert s.classify(7, digest=70) == "apply"
    s.applied(7, 70)
    assert s.next == 8
    assert s.classify(8, 80) == "apply"
    assert s.classify(10, 100) == "gap"


def test_an_applied_batch_seen_again_is_skipped_unless_its_contents_changed():
    s = BatchSequence()
    for seq in range(3):
        s.applied(seq, seq * 10)
    assert s.classify(1, 10) == "applied"  # a replay overlapping the live socket
    assert s.classify(1, 11) == "changed"  # same number, other contents: another process
    assert s.digest(2) == 20 and s.digest(3) is None


def test_a_live_number_that_goes_back_means_a_new_process():
    s = BatchSequence()
    assert not s.went_back(5)
    s.last_live = 5
    assert s.went_back(5) and s.went_back(0) and not s.went_back(6)
    s.reset()
    assert not s.went_back(0) and s.next is None and s.digest(0) is None


def test_forgetting_the_position_keeps_the_digests_that_recognise_the_process():
    s = BatchSequence()
    s.applied(4, 40)
    s.forget_position()
    assert s.next is None and s.classify(9, 90) == "apply"
    assert s.digest(4) == 40


def test_only_the_last_window_of_digests_is_kept():
    s = BatchSequence(window=3)
    for seq in range(5):
        s.applied(seq, seq)
    assert [s.digest(q) for q in range(5)] == [None, None, 2, 3, 4]
    assert s.classify(0, 999) == "applied"  # too old to tell: not taken for a restart


# -- the index writer (router/fleet/kvevents/index_writer.py), on a real memory index -------------------
async def _writer_with(index):
    from prometheus_client import CollectorRegistry

    from tests.router_support import index_client
    from kvroute.router.fleet.kvevents.index_writer import IndexWriter
    from kvroute.router.fleet.kvevents.metrics import KVEventMetrics

    return IndexWriter("r", index_client(index), KVEventMetrics(CollectorRegistry()))


async def test_writes_are_coalesced_in_order_and_a_clear_makes_earlier_ones_moot():
    from kvroute.router.index.base import ReplicaSpec
    from kvroute.router.index.memory import MemoryIndex

    index = MemoryIndex()
    await index.add_replica(ReplicaSpec("r", 1000, publishes_events=True))
    writer = await _writer_with(index)
    writer.add("confirm", [1, 2])
    writer.add("confirm", [3])  # one run: one call
    writer.add("remove", [3])
    writer.batch(None)
    assert writer._ops == [("confirm", [1, 2, 3]), ("remove", [3])]
    assert await writer.flush() is True
    assert await index.lookup([1, 2, 3]) == {"r": 2}
    assert writer.batches_applied == 1

    writer.add("confirm", [7])
    writer.add("clear", [])
    writer.add("confirm", [1])
    writer.batch(None)
    assert writer._ops == [("clear", []), ("confirm", [1])]
    assert await writer.flush() is True
    assert await index.lookup([1, 2]) == {"r": 1}
    assert await writer.flush() is None  # nothing pending
