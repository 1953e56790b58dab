"""KV cache events of vLLM replicas → confirmed / removed entries of the prefix index.

``wire`` decodes vLLM's frames and msgpack (both encodings), ``translate`` turns engine block
hashes into the router's own, ``stream`` follows one replica (sequence gaps, replays, restarts),
``subscriber`` holds the streams and follows the fleet, ``metrics`` counts it all.
"""

from kvroute.router.fleet.kvevents.metrics import KVEventMetrics
from kvroute.router.fleet.kvevents.stream import StreamStatus
from kvroute.router.fleet.kvevents.subscriber import KVEventSubscriber, base_model
from kvroute.router.fleet.kvevents.translate import SKIP_REASONS, ChainTranslator
from kvroute.router.fleet.kvevents.wire import AllBlocksCleared, Batch, BatchDecoder, BlockRemoved, BlockStored, WireError

__all__ = [
    "SKIP_REASONS",
    "AllBlocksCleared",
    "Batch",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "ChainTranslator",
    "KVEventMetrics",
    "KVEventSubscriber",
    "StreamStatus",
    "WireError",
    "base_model",
]
