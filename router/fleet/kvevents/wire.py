"""vLLM's KV-event wire format (docs/design.md §4.1), decoded with msgspec
(``vllm/distributed/kv_events.py``).

Live frames: ``(topic, seq as 8-byte big-endian, msgpack EventBatch)``.  Replay replies, as a
DEALER sees them: ``[b"", seq, payload]`` (vLLM) or ``[b"", topic, seq, payload]`` (vLLM since
#45177), ending with seq −1 and an empty payload in the same shape.

Two encodings exist and both are accepted:

- the batch is a positional array ``[ts, events, data_parallel_rank]`` (what running vLLM sends)
  or a map ``{"ts", "events", "data_parallel_rank"}`` (vLLM main dropped ``array_like``);
- each event is a map tagged by ``"type"`` (vLLM ≥ 0.24) or a positional array whose first
  element is the tag (≤ 0.23): ``["BlockStored", block_hashes, parent, token_ids, block_size,
  lora_id, medium, ...]``.

msgspec cannot mix array-like and map-like structs in one union, so the batch's first byte picks
its decoder, and the event form is learned per stream (tried first, the other one on failure).
A batch holding an event type this module does not know is decoded event by event, and only the
unknown events are dropped.  Block hashes are ints (vLLM's default: the low 64 bits) or bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); both are kept as they come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

EngineHash = int | bytes
END_SEQ = -1


class KVEvent(msgspec.Struct, tag=True, gc=False):
    """Tagged-map event (key ``"type"``); unknown fields are ignored, so newer vLLMs decode."""


class BlockStored(KVEvent):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # deprecated in vLLM: only a LoRA's slot, not its name
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: what entered that block's hash besides its tokens (LoRA name,
    # multimodal hashes, cache_salt on a chain's first block, prompt-embedding hashes).
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVEvent):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVEvent):
    pass


# The positional forms subclass the map forms, so consumers test one class either way.
class _LegacyBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _LegacyBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _LegacyAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared


class _ArrayBatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchOfArrays(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _MapBatchOfMaps(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _MapBatchOfArrays(msgspec.Struct, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatchRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class Batch:
    ts: float  # the engine's time.time() when it published the step
    events: list[Event]
    data_parallel_rank: int | None
    undecodable: int = 0  # events dropped: an unknown type or a malformed event


class WireError(ValueError):
    """A frame or payload that is not vLLM's KV-event format."""


EventForm = Literal["map", "array"]
_DEC = msgspec.msgpack.Decoder  # the decoders below are built once, at import

_BATCH = {
    ("array", "map"): _DEC(_ArrayBatchOfMaps),
    ("array", "array"): _DEC(_ArrayBatchOfArrays),
    ("map", "map"): _DEC(_MapBatchOfMaps),
    ("map", "array"): _DEC(_MapBatchOfArrays),
}
_RAW_BATCH = {"array": _DEC(_ArrayBatchRaw), "map": _DEC(_MapBatchRaw)}
_ONE_EVENT = {"map": _DEC(_MapEvent), "array": _DEC(_ArrayEvent)}


def batch_shape(payload: bytes) -> Literal["array", "map"]:
    """The msgpack container type of the batch, from its first byte."""
    if not payload:
        raise WireError("empty payload")
    b = payload[0]
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    raise WireError(f"payload is neither a msgpack array nor a map (first byte 0x{b:02x})")


class BatchDecoder:
    """Decodes one stream's payloads; remembers which event form the stream uses."""

    __slots__ = ("event_form",)

    def __init__(self, event_form: EventForm = "map") -> None:
        self.event_form: EventForm = event_form

    def decode(self, payload: bytes) -> Batch:
        shape = batch_shape(payload)
        first = self.event_form
        other: EventForm = "array" if first == "map" else "map"
        for form in (first, other):
            try:
                raw = _BATCH[shape, form].decode(payload)
            except msgspec.DecodeError:
                continue
            self.event_form = form
            return Batch(raw.ts, raw.events, raw.data_parallel_rank)
        return self._decode_each(payload, shape)

    def _decode_each(self, payload: bytes, shape: Literal["array", "map"]) -> Batch:
        """Slow path: some event does not decode (a new type?): keep every one that does."""
        try:
            raw = _RAW_BATCH[shape].decode(payload)
        except msgspec.DecodeError as exc:
            raise WireError(f"not an EventBatch: {exc}") from None
        events: list[Event] = []
        bad = 0
        for item in raw.events:
            event = None
            for form in (self.event_form, "array" if self.event_form == "map" else "map"):
                try:
                    event = _ONE_EVENT[form].decode(item)
                    break
                except msgspec.DecodeError:
                    continue
            if event is None:
                bad += 1
            else:
                events.append(event)
        return Batch(raw.ts, events, raw.data_parallel_rank, undecodable=bad)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def parse_live(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise WireError(f"live message of {len(frames)} frames, expected 3")
    return seq_of(frames[1]), frames[2]


def parse_replay(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a replay reply; seq is ``END_SEQ`` for the end marker."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the DEALER's empty delimiter
    if len(frames) == 3:  # topic, seq, payload
        frames = frames[1:]
    if len(frames) != 2:
        raise WireError(f"replay reply of {len(frames)} frames")
    return seq_of(frames[0]), frames[1]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with seq >= ``start_seq``."""
    return [b"", start_seq.to_bytes(8, "big")]


__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "Batch",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "Event",
    "KVEvent",
    "WireError",
    "batch_shape",
    "parse_live",
    "parse_replay",
    "replay_request",
    "seq_of",
]
