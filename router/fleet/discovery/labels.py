"""A replica's ``replica`` label in the metrics: the name discovery gives, not its URL.

A pod gets a new IP at every restart, so a URL label starts new series each time (and dashboards
lose the replica's history); a name is stable.  The rule, first that applies:
- a name a source gives: the pod's (Kubernetes), the config file's ``name`` of a static entry;
- the Redis registration's name, when it is not its URL (the default);
- the URL's ``host:port`` (a static entry, a DNS address): Prometheus' ``instance`` of the replica.
A label two replicas would share (two entries of one name), or the reserved ``none`` (requests
answered before any replica was chosen), is replaced by the URL, which is unique.  The URL is
always in ``kvroute_replica_info{replica,url,model}``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from kvroute.common.registration import ReplicaRecord

RESERVED = frozenset({"none"})  # router/worker_metrics.py's UNROUTED


def replica_label(url: str, names: Iterable[str | None], record: ReplicaRecord | None) -> str:
    """The label of the replica at ``url``, given the names its sources give and its registration."""
    for name in names:
        if name:
            return name
    if record is not None and record.name and record.name.rstrip("/") != record.url:
        return record.name
    return urlsplit(url).netloc or url


def unique_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` (URL -> label) with each shared or reserved label replaced by its URL."""
    used = Counter(labels.values())
    return {url: label if used[label] == 1 and label not in RESERVED else url for url, label in labels.items()}
