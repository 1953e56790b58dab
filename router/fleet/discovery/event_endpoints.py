"""Where a replica's KV events come from, whichever source found it (docs/design.md §4.7).

In order: its Redis registration (one without an events endpoint publishes none), else its
config-file entry ``{url, events_endpoint, replay_endpoint}`` (an endpoint left out follows the
convention, an empty one means none), else the convention: the host of its HTTP URL on the fleet's
``events_port`` / ``replay_port`` (vLLM's ``tcp://*:5557`` and a replay socket beside it; a port of
0 turns that half off).  A conventional endpoint that two replicas on one host would share is
followed for neither (logged once): the config file must name theirs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, field_validator

from kvroute.common.registration import ReplicaRecord

from kvroute.router.fleet.discovery.base import normalize_url

log = logging.getLogger("kvroute.router.fleet")

EndpointOrigin = Literal["registered", "configured", "convention"]
SCHEMES = ("tcp://", "ipc://", "inproc://")


class ReplicaEntry(BaseModel):
    """A replica of the config file given as an object rather than a plain URL."""

    model_config = ConfigDict(extra="forbid")

    url: str
    name: str | None = None  # its metrics' replica label (else its host:port)
    events_endpoint: str | None = None  # None: by convention; "": it publishes none
    replay_endpoint: str | None = None  # None: by convention; "": it has no replay socket

    @field_validator("events_endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value and not value.startswith(SCHEMES):
            raise ValueError(f"a ZMQ address (tcp://HOST:PORT, ipc://PATH), got {value!r}")
        return value


def entry_url(entry: str | ReplicaEntry) -> str:
    return entry.url if isinstance(entry, ReplicaEntry) else entry


@dataclass(frozen=True)
class EventEndpoints:
    events: str | None = None  # None: the replica publishes no KV events we know of
    replay: str | None = None
    origin: EndpointOrigin | None = None


NO_EVENTS = EventEndpoints()


def conventional(url: str, port: int) -> str | None:
    """``tcp://HOST:port`` for the host of ``url``; None when the port is 0 (off)."""
    host = urlsplit(url).hostname
    if not port or not host:
        return None
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class EventEndpointResolver:
    """The fleet's rule for each replica's endpoints (see the module docstring)."""

    def __init__(self, entries: Iterable[str | ReplicaEntry], *, events_port: int, replay_port: int):
        self._overrides: dict[str, ReplicaEntry] = {
            normalize_url(e.url): e for e in entries if isinstance(e, ReplicaEntry)
        }
        self._events_port = events_port
        self._replay_port = replay_port
        self._warned: set[str] = set()

    def resolve(self, urls: Iterable[str], records: Mapping[str, ReplicaRecord]) -> dict[str, EventEndpoints]:
        """The endpoints of each of ``urls`` (normalized base URLs), given their registrations."""
        out = {url: self._one(url, records.get(url)) for url in urls}
        shared = Counter(ep.events for ep in out.values() if ep.origin == "convention")
        for url, ep in out.items():
            if ep.origin == "convention" and shared[ep.events] > 1:
                if ep.events not in self._warned:
                    self._warned.add(ep.events)  # type: ignore[arg-type]
                    log.warning("KV events at %s would be several replicas' (same host): following none of "
                                "them by convention; give each its events_endpoint in the config file", ep.events)
                out[url] = NO_EVENTS
        return out

    def _one(self, url: str, record: ReplicaRecord | None) -> EventEndpoints:
        if record is not None:
            if not record.events_endpoint:
                return NO_EVENTS
            return EventEndpoints(record.events_endpoint, record.replay_endpoint or None, "registered")
        entry = self._overrides.get(url)
        events = self._pick(entry.events_endpoint if entry else None, url, self._events_port)
        if not events:
            return NO_EVENTS
        replay = self._pick(entry.replay_endpoint if entry else None, url, self._replay_port)
        configured = entry is not None and (entry.events_endpoint is not None or entry.replay_endpoint is not None)
        return EventEndpoints(events, replay, "configured" if configured else "convention")

    @staticmethod
    def _pick(given: str | None, url: str, port: int) -> str | None:
        return (given or None) if given is not None else conventional(url, port)
