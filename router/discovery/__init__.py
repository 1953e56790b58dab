"""Where replicas come from: each source its own module behind :class:`DiscoverySource`.

A static list, registrations in Redis (a registration whose TTL lapses leaves) and a DNS name
whose addresses are the replicas (a Kubernetes headless service), and the ready pods a Kubernetes
label selector matches, watched through the API.  Any may be combined; the fleet
merges their listings every health interval.  A source that fails to answer keeps its last
answer, so a Redis or DNS blip never empties the fleet.
"""

from .base import DiscoverySource, Listing, Source, normalize_url
from .dns import DnsSource, address_url, select_addresses
from .k8s import K8sSource
from .metrics import DiscoveryMetrics
from .redis_source import RedisSource
from .static import StaticSource

__all__ = [
    "DiscoveryMetrics",
    "DiscoverySource",
    "DnsSource",
    "K8sSource",
    "Listing",
    "RedisSource",
    "Source",
    "StaticSource",
    "address_url",
    "normalize_url",
    "select_addresses",
]
