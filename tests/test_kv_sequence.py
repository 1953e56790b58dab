"""The KV-event batch numbering on its own (router/kvevents/sequence.py): no sockets needed."""

from router.kvevents.sequence import BatchSequence


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
