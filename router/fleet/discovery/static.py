"""Replicas named in the settings (``--replicas``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing, normalize_url


class StaticSource(DiscoverySource):
    name = "static"

    def __init__(self, urls: Iterable[str], names: Mapping[str, str] | None = None):
        self._listing: Listing = dict.fromkeys(normalize_url(u) for u in urls)
        self._names = {normalize_url(url): name for url, name in (names or {}).items()}  # the config file's

    async def list(self) -> Listing:
        return dict(self._listing)

    def label(self, url: str) -> str | None:
        return self._names.get(url)
