"""The model catalogue: what the fleet's replicas serve, read from their /v1/models cards (a LoRA
adapter's card names its base model; ``max_model_len`` bounds a prompt)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.router.fleet.replica import Replica


def card_parent(card: Mapping[str, Any]) -> str | None:
    """The base model a LoRA adapter's model card names (vLLM's /v1/models gives an adapter's
    card a ``parent``); None for a base model's card."""
    parent = card.get("parent")
    return parent if isinstance(parent, str) and parent and parent != card.get("id") else None


def adapter_of(model: str, replicas: Sequence[Replica]) -> tuple[str | None, str]:
    """(LoRA adapter, base model) of a served model name: vLLM's /v1/models gives an adapter's card
    a ``parent`` (its base model).  The adapter gets its own chain namespace either way."""
    for r in replicas:
        for card in r.model_cards:
            if card.get("id") == model:
                parent = card_parent(card)
                return (model, parent) if parent else (None, model)
    return None, model


def max_model_len(model: str, replicas: Sequence[Replica]) -> int | None:
    """The longest context the replicas serving ``model`` announce (vLLM's ``max_model_len`` in
    /v1/models): a longer prompt is refused by every engine, so the router refuses it first,
    without tokenizing all of a huge one."""
    lengths = [card.get("max_model_len") for r in replicas for card in r.model_cards if card.get("id") == model]
    return max((n for n in lengths if type(n) is int and n > 0), default=None)
