"""Where replicas come from: each source its own module behind :class:`DiscoverySource`.

A static list, registrations in Redis (a registration whose TTL lapses leaves) and a DNS name
whose addresses are the replicas (a Kubernetes headless service), and the ready pods a Kubernetes
label selector matches, watched through the API.  Any may be combined; the fleet
merges their listings every health interval.  A source that fails to answer keeps its last
answer, so a Redis or DNS blip never empties the fleet.  ``event_endpoints`` says where each
replica's KV events are, whichever source found it.
"""

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing, Source, normalize_url
from kvroute.router.fleet.discovery.dns import DnsSource, address_url, select_addresses
from kvroute.router.fleet.discovery.event_endpoints import EventEndpointResolver, EventEndpoints, ReplicaEntry, entry_url
from kvroute.router.fleet.discovery.k8s import K8sSource
from kvroute.router.fleet.discovery.labels import replica_label, unique_labels
from kvroute.router.fleet.discovery.metrics import DiscoveryMetrics
from kvroute.router.fleet.discovery.redis_source import RedisSource
from kvroute.router.fleet.discovery.static import StaticSource

__all__ = [
    "DiscoveryMetrics",
    "DiscoverySource",
    "DnsSource",
    "EventEndpointResolver",
    "EventEndpoints",
    "K8sSource",
    "Listing",
    "RedisSource",
    "ReplicaEntry",
    "Source",
    "StaticSource",
    "address_url",
    "entry_url",
    "normalize_url",
    "replica_label",
    "select_addresses",
    "unique_labels",
]
