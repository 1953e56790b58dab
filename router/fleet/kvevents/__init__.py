"""KV cache events of vLLM replicas → confirmed / removed entries of the prefix index.

``wire`` decodes vLLM's frames and msgpack (both encodings), ``translate`` turns engine block
hashes into the router's own, ``stream`` follows one replica (sequence gaps, replays, restarts),
``subscriber`` holds the streams and follows the fleet, ``metrics`` counts it all.
"""

from .metrics import KVEventMetrics
from .stream import StreamStatus
from .subscriber import KVEventSubscriber, base_model
from .translate import SKIP_REASONS, ChainTranslator
from .wire import AllBlocksCleared, Batch, BatchDecoder, BlockRemoved, BlockStored, WireError

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
