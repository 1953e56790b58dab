"""The interface every discovery source implements."""

from __future__ import annotations

import abc
from typing import Literal

from kvroute.common.registration import ReplicaRecord

Source = Literal["static", "redis", "dns", "k8s"]
# the replicas a source lists now, by base URL, with their registration where the source has one
Listing = dict[str, ReplicaRecord | None]


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class DiscoverySource(abc.ABC):
    name: Source

    @abc.abstractmethod
    async def list(self) -> Listing:
        """The replicas this source lists now; on failure, its last good answer (logged)."""

    def label(self, url: str) -> str | None:
        """The name this source knows the replica at ``url`` by (a pod's name, a configured name),
        its metrics' ``replica`` label; None: it names none (fleet/discovery/labels.py decides)."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections this source opened."""
