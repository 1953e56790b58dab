"""Replicas named in the settings (``--replicas``)."""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing, normalize_url


class StaticSource(DiscoverySource):
    name = "static"

    def __init__(self, urls: Iterable[str]):
        self._listing: Listing = dict.fromkeys(normalize_url(u) for u in urls)

    async def list(self) -> Listing:
        return dict(self._listing)
