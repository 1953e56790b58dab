"""A request's route: where it goes, decided once, and again when its replica fails before the
first byte (docs/design.md §1).

the prompt (``prompt.py``: tokens) -> block chain (seed: model, LoRA adapter, cache_salt) -> the
routing sequence of ``router/placement/sequence.py`` (index lookup -> policy over a snapshot of
the eligible replicas -> the router takes a half-open replica's trial -> record the prediction
and the load) -> a frozen :class:`Route`.  The edge forwards it and asks :meth:`Router.reroute`
for the next one when the replica failed before its first byte; what happened after is
``accounting.py``'s.

Tenant isolation: the forwarded ``cache_salt`` is HMAC(secret, the client's API key), joined to any
salt the client chose, so a tenant can neither pick another's salt nor learn it; the salt also
seeds the chain, so the index never shares blocks across tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from kvroute.common.blocks import namespace_seed
from kvroute.common.errors import ApiError
from kvroute.common.requests import ParsedRequest, chat_roles
from kvroute.common.tokens import PromptTooLong

from kvroute.router.config import RouterSettings
from kvroute.router.fleet.catalogue import adapter_of, max_model_len
from kvroute.router.fleet.membership import Fleet
from kvroute.router.fleet.replica import Replica
from kvroute.router.metrics import RouterMetrics
from kvroute.router.placement.hold import Holds
from kvroute.router.placement.policy.base import Choice, Query, ReplicaState
from kvroute.router.placement.sequence import Placement
from kvroute.router.request.chain_memo import ChainMemo
from kvroute.router.request.prompt import Prompt, PromptBuilder, prompt_too_long

_NONE: Mapping[str, Any] = MappingProxyType({})
# Chat bodies from this size on have their messages counted before they are parsed (a smaller one
# holds at most a couple of thousand messages: rendered in milliseconds).
OVERSIZE_CHECK_MIN_BYTES = 64 * 1024


def tenant_salt(api_key: str, secret: bytes) -> str:
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def client_label(user: str | None, api_key: str | None) -> str:
    """Who sent it, for per-client metrics: the ``user`` field, else a digest of the key (never the key)."""
    if user:
        return user[:64]
    if api_key:
        return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:10]
    return "anonymous"


@dataclass(frozen=True, slots=True)
class Route:
    """One request's route as the router decided it.  Frozen, as all it holds: a failover is a
    new route (:meth:`Router.reroute`).  The edge hands it to the proxy (``replica``, ``url``) and
    to the accounting; it holds data only."""

    request_id: str
    load_key: str  # the load tracker's key: unique even when clients repeat request ids
    model: str
    client: str  # who sent it, for per-client metrics
    prompt: Prompt
    chains: tuple[tuple[int, ...], ...]  # one per prompt of the batch
    seed: int  # the chains' namespace seed
    query: Query  # what the policy saw (matches included)
    replica: str
    url: str  # the replica's base URL when it was chosen
    reason: str
    predicted_blocks: int  # what the policy believed the replica held
    tried: tuple[str, ...] = ()  # replicas that failed before the first byte
    additions: Mapping[str, Any] = field(default_factory=lambda: _NONE)  # body fields routing adds upstream


class Router:
    """Decides where a request goes: ``route`` -> a :class:`Route`; ``reroute`` -> the next one.
    It calls down only (the prompt builder, the fleet, the placement); it never forwards."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        fleet: Fleet,
        placement: Placement,
        prompts: PromptBuilder,
        metrics: RouterMetrics,
        holds: Holds | None = None,
    ):
        self.settings = settings
        self.fleet = fleet
        self.placement = placement
        self.prompts = prompts
        self.metrics = metrics
        self.holds = holds  # late binding (placement/hold.py), None: off
        self._ids = itertools.count()
        self.chains = ChainMemo()
        self._salt_key = (
            settings.tenant_salt_secret.get_secret_value().encode() if settings.tenant_salt_secret else b"kvroute-tenant"
        )

    async def route(
        self,
        parsed: ParsedRequest,
        *,
        request_id: str,
        session_header: str | None,
        api_key: str | None,
        pin: str | None = None,
    ) -> Route:
        """``pin``: the replica that must take it while eligible (it holds state the request names)."""
        req = parsed.request
        model = req.model
        replicas = self.eligible(model)
        if pin is not None:
            replicas = [r for r in replicas if r.name == pin] or replicas
        lora, base = adapter_of(model, replicas)

        additions: dict[str, Any] = {}
        salt = req.cache_salt
        session_key = session_header or req.user
        if self.settings.tenant_isolation:
            tenant = tenant_salt(api_key or "", self._salt_key)
            salt = f"{tenant}.{salt}" if salt else tenant
            additions["cache_salt"] = salt
            if session_key:
                session_key = f"{tenant}.{session_key}"
        if parsed.stream and not parsed.client_wants_usage:
            additions["stream_options"] = {**(parsed.body.get("stream_options") or {}), "include_usage": True}

        limit = self.settings.max_prompt_tokens  # of the whole batch
        per_prompt = self._prompt_limit(model, replicas)
        try:
            prompt = await self.prompts.build(parsed, model, base, per_prompt)
        except PromptTooLong as exc:
            prompt_too_long(parsed, str(exc))
        if limit is not None and prompt.tokens > limit:
            prompt_too_long(parsed, f"prompt is {prompt.tokens} tokens long, more than the limit of {limit}")
        block_size = self.fleet.block_size(model)
        seed = namespace_seed(base, lora, salt)
        chains = tuple(tuple(self.chains.chain(data, block_size, seed)) for data in prompt.data)
        query = Query(
            chain=chains[0],
            prompt_tokens=prompt.tokens,
            block_size=block_size,
            session_key=session_key,
            text=prompt.text,
            now=time.monotonic(),
        )
        load_key = f"{request_id}#{next(self._ids)}"  # client ids may repeat; load keys must not
        query = await self.placement.lookup(query)
        if self.holds is None:
            replica, choice = self._place(query, replicas, load_key, chains)
        else:
            query, replica, choice = await self._place_late(model, query, replicas, load_key, chains, pin)
        self.metrics.decision(choice.reason)
        return Route(
            request_id=request_id,
            load_key=load_key,
            model=model,
            client=client_label(req.user, api_key),
            prompt=prompt,
            chains=chains,
            seed=seed,
            query=query,
            replica=choice.replica,
            url=replica.url,
            reason=choice.reason,
            predicted_blocks=choice.matched_blocks,
            additions=MappingProxyType(additions),
        )

    def _prompt_limit(self, model: str, replicas: Sequence[Replica]) -> int | None:
        """The most tokens one prompt may have: max_prompt_tokens, and the replicas' max_model_len."""
        limits = (self.settings.max_prompt_tokens, max_model_len(model, replicas))
        return min((n for n in limits if n is not None), default=None)

    def refuse_oversized_chat(self, raw: bytes) -> None:
        """A chat body whose messages alone are over the prompt-length limit: a 400
        ``context_length_exceeded`` before it is parsed, rendered or tokenized (docs/design.md §7.5).
        The bound counts the special tokens the model's template marks each message with (probed
        at load, common/tokens/bounds.py), so it never refuses a prompt the engine would take; a
        body this cannot read, a model no replica serves, a request's own template: left to the
        full parse and the tokenizer's own limit."""
        if len(raw) < OVERSIZE_CHECK_MIN_BYTES:
            return  # a small chat renders in a millisecond or two: nothing to save
        shape = chat_roles(raw)
        if shape is None or type(shape[0]) is not str:
            return
        model, roles = shape
        replicas = self.fleet.eligible(model)
        if not replicas:
            return  # route() answers 404 or 503
        _, base = adapter_of(model, replicas)
        limit = self._prompt_limit(model, replicas)
        tok = self.prompts.tokenizer(model, base)
        if limit is None or tok is None:
            return
        # the last message may lose its end-of-turn token (continue_final_message): not counted
        at_least = tok.chat_tokens_at_least(roles[:-1])
        if at_least > limit:
            raise ApiError(
                400,
                f"prompt is at least {at_least} tokens long ({len(roles)} messages, each marked by the chat template's "
                f"special tokens), more than the limit of {limit}",
                param="messages",
                code="context_length_exceeded",
            )

    def reroute(self, route: Route) -> Route | None:
        """``route.replica`` failed before the first byte: the next best replica's route, or None
        when the attempts are spent or no other replica is eligible."""
        self.placement.finished(route.load_key)
        tried = (*route.tried, route.replica)
        if len(tried) > self.settings.retry_attempts:
            return None
        replicas = [r for r in self.fleet.eligible(route.model) if r.name not in tried]
        if not replicas:
            return None
        replica, choice = self._place(route.query, replicas, route.load_key, route.chains)
        self.metrics.decision("failover")
        return replace(
            route, replica=choice.replica, url=replica.url, reason="failover", predicted_blocks=choice.matched_blocks,
            tried=tried,
        )

    async def _place_late(
        self, model: str, query: Query, replicas: Sequence[Replica], load_key: str, chains: Sequence[Sequence[int]], pin: str | None
    ) -> tuple[Query, Replica, Choice]:
        """Late binding (docs/design.md §5.9): the policy's pick, unless it has no room; then the
        request waits in that replica's line (``Holds``) until it has room or the budget is spent,
        and is placed again with the fleet, the index's matches and the load of that moment."""
        assert self.holds is not None
        first = self.placement.choose(query, self._snapshot(replicas))
        if not self.holds.must_wait(first.replica):
            return (query, *self._place(query, replicas, load_key, chains, first=first))
        self.metrics.held_now.inc()
        try:
            async with self.holds.turn(first.replica):
                now = self.fleet.eligible(model) or list(replicas)  # the fleet of this moment
                if pin is not None:
                    now = [r for r in now if r.name == pin] or now
                query = await self.placement.lookup(replace(query, now=time.monotonic()))
                return (query, *self._place(query, now, load_key, chains))
        finally:
            self.metrics.held_now.dec()

    def _place(
        self, query: Query, replicas: Sequence[Replica], load_key: str, chains: Sequence[Sequence[int]],
        first: Choice | None = None,
    ) -> tuple[Replica, Choice]:
        """choose -> claim -> commit: the policy's pick (``first`` if already asked), whose
        half-open trial (if it is one) this request takes; a replica whose trial another request
        took since the snapshot is passed over while others remain."""
        by_name = {r.name: r for r in replicas}
        states = self._snapshot(replicas)
        while True:
            choice = first or self.placement.choose(query, states)
            first = None
            if self.fleet.claim(choice.replica) or len(states) <= 1:
                break
            states = [s for s in states if s.name != choice.replica]
        self.placement.commit(query, choice, load_key, chains)
        return by_name[choice.replica], choice

    def _snapshot(self, replicas: Sequence[Replica]) -> list[ReplicaState]:
        return [self.placement.snapshot(r.name, r.running) for r in replicas]

    def eligible(self, model: str) -> list[Replica]:
        """Replicas that may take a request for ``model``; 404 if none serves it, 503 if none is up,
        502 if none serves it while some refuse the router's API key or fail TLS (docs/design.md §7.5)."""
        replicas = self.fleet.eligible(model)
        if replicas:
            return replicas
        if self.fleet.serves(model):
            raise ApiError(
                503,
                f"no healthy replica is serving model {model!r} right now",
                code="no_replica_available",
                headers={"Retry-After": str(max(1, self.settings.retry_after_s))},
            )
        refusing = self.fleet.auth_refused()
        if refusing:  # their models are unknown: the router's key is the problem, not the client's request
            raise ApiError(
                502,
                f"no replica known to serve model {model!r}: replica(s) {_some(refusing)} refuse the router's API key "
                f"({refusing[0].auth_refused}); the router's operator must set fleet.replica_api_key",
                code="upstream_auth_failed",
            )
        failing = self.fleet.tls_failed()
        if failing:  # the same: the router's (or the replicas') TLS settings are the problem
            raise ApiError(
                502, f"no replica known to serve model {model!r}: TLS with replica(s) {_some(failing)} fails: "
                f"{failing[0].tls_failed}", code="upstream_tls_failed",
            )
        raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")


def _some(replicas: Sequence[Replica]) -> str:
    """A few replicas' names for a message."""
    return ", ".join(sorted(r.name for r in replicas)[:3]) + (" and others" if len(replicas) > 3 else "")
