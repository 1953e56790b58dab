"""RouterMetrics' per-request counting: children bound once, rebound after a replica leaves."""

from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.metrics import RouterMetrics


def _requests(m: RouterMetrics) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["model"], s.labels["replica"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
        if s.name == "kvroute_requests_total"
    }


def test_answered_counts_by_label_set_and_a_returning_replica_starts_again():
    m = RouterMetrics("cost_model")
    for status in (200, 200, 503):
        m.answered("tiny", "a", status)
    m.answered("tiny", "b", 200)
    assert _requests(m) == {("tiny", "a", "200"): 2, ("tiny", "a", "503"): 1, ("tiny", "b", "200"): 1}
    m.forget_replica("a")
    assert _requests(m) == {("tiny", "b", "200"): 1}
    m.answered("tiny", "a", 200)  # the same address back (a pod restarted): a new series, not the dropped one
    assert _requests(m) == {("tiny", "a", "200"): 1, ("tiny", "b", "200"): 1}
