"""The per-request routing pipeline.

tokenize -> block chain (seed: model, LoRA adapter, cache_salt) -> the routing sequence of
``placement.py`` (index lookup -> policy over a snapshot of the eligible replicas -> record the
prediction and the load) -> an immutable :class:`RouteDecision`.  The app forwards it through the
proxy and reports back: ``reroute`` (failed before the first byte), ``first_token``, ``report``.

Every prompt is routed on its whole token ids: the decision, the load it charges and the
prediction it records all need the prompt's real length and chain (docs/design.md §1 says why a
prompt is never routed on an estimate of its head).

Tokens: the model's own tokenizer and chat template when one is configured (exact block
hashes).  Without one the router still routes cache-aware, approximately: the prompt's UTF-8
bytes are cut into 4-byte words used as pseudo tokens (about one real token each in English), so
equal text prefixes still give equal chains, only the block boundaries differ from the engine's.
A chat whose template cannot be rendered (images, a template that rejects the messages) uses the
same approximation and lets the engine give its own verdict.

Tenant isolation: the forwarded ``cache_salt`` is HMAC(secret, the client's API key), joined to any
salt the client chose, so a tenant can neither pick another's salt nor learn it; the salt also
seeds the chain, so the index never shares blocks across tenants.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import numpy as np

from kvroute.common.blocks import namespace_seed, token_bytes
from kvroute.common.errors import ApiError
from kvroute.common.requests import ParsedRequest, prompt_batch
from kvroute.common.tokens import ClientTemplateRefused, PromptTooLong, TokenizerError, TokenizerRegistry

from kvroute.router.request.chain_memo import ChainMemo
from kvroute.router.config import RouterSettings
from kvroute.router.fleet.membership import Fleet, Replica, card_parent
from kvroute.router.index.client import IndexClient
from kvroute.router.placement.load import LoadTracker
from kvroute.router.metrics import RouterMetrics
from kvroute.router.placement.sequence import Placement, snapshot
from kvroute.router.placement.policy.base import Policy, ReplicaState, RouteRequest
from kvroute.router.forwarding.proxy import Outcome
from kvroute.router.request.reuse import ReuseTracker

log = logging.getLogger("kvroute.router")

# body fields of a chat request that change the rendered prompt (vLLM's ChatCompletionRequest)
_RENDER_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template")


def approximate_token_bytes(text: str) -> bytes:
    """Pseudo tokens for a model without a tokenizer: the UTF-8 bytes as little-endian uint32 words."""
    data = text.encode("utf-8")
    pad = -len(data) % 4
    return data + b"\0" * pad if pad else data


def chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """A chat flattened to text (approximate mode, and the text-matching baselines)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
        parts.append(f"<{m.get('role')}>{content or ''}")
    return "\n".join(parts)


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


def check_client_template(body: Mapping[str, Any], allowed: bool) -> None:
    """A request's own ``chat_template``: a 400 unless this router renders them (in a worker)."""
    template = body.get("chat_template")
    if template is None:
        return
    if not isinstance(template, str):
        raise ApiError(400, "chat_template must be a string", param="chat_template", code="invalid_type")
    if not allowed:
        raise ApiError(
            400,
            "this router renders only the model's own chat template; a request's chat_template is accepted "
            "when the operator enables it (--allow-client-chat-template, KVROUTE_ALLOW_CLIENT_CHAT_TEMPLATE=true)",
            param="chat_template",
            code="client_chat_template_disabled",
        )


def prompt_too_long(parsed: ParsedRequest, message: str) -> NoReturn:
    param = {"chat": "messages", "responses": "input"}.get(parsed.kind, "prompt")
    raise ApiError(400, message, param=param, code="context_length_exceeded")


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
class Prompt:
    """What routing computed from the request body."""

    data: list[bytes]  # per prompt of the batch: its token ids as uint32 little-endian bytes
    tokens: int
    text: str
    exact: bool  # tokenized with the model's own tokenizer


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One request's route as routing decided it.  Immutable: a failover is a new decision.

    The app hands it to the proxy (``replica``) and back to :meth:`Router.reroute`,
    :meth:`Router.first_token` and :meth:`Router.report`; it holds data only.
    """

    request_id: str
    load_key: str  # the load tracker's key: unique even when clients repeat request ids
    model: str
    client: str  # who sent it, for per-client metrics
    prompt: Prompt
    chains: tuple[list[int], ...]  # one per prompt of the batch
    seed: int  # the chains' namespace seed
    route: RouteRequest  # what the policy saw (matches included)
    replica: str
    reason: str
    predicted_blocks: int  # what the policy believed the replica held
    tried: tuple[str, ...] = ()  # replicas that failed before the first byte
    additions: Mapping[str, Any] = field(default_factory=dict)  # body fields routing adds upstream


class Router:
    """Decides where a request goes and learns from how it went; it never calls the proxy.

    ``route`` -> a :class:`RouteDecision`; the app forwards it, asks ``reroute`` when the replica
    failed before the first byte, tells ``first_token`` when the first token came back, and
    ends with ``report``.
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        fleet: Fleet,
        index: IndexClient,
        load: LoadTracker,
        policy: Policy,
        tokenizers: TokenizerRegistry,
        reuse: ReuseTracker,
        metrics: RouterMetrics,
    ):
        self.settings = settings
        self.fleet = fleet
        self.load = load
        self.policy = policy
        # the client bounds the lookup by index_timeout_s and writes predictions behind the answer
        self.placement = Placement(policy, index, load, claim=fleet.claim)
        self.tokenizers = tokenizers
        self.reuse = reuse
        self.metrics = metrics
        self._ids = itertools.count()
        self.chains = ChainMemo()
        self._explicit_tokenizers = set(tokenizers.models())
        self._salt_key = (
            settings.tenant_salt_secret.get_secret_value().encode() if settings.tenant_salt_secret else b"kvroute-tenant"
        )
        self._approx_warned: set[str] = set()
        self._reports_cached: set[str] = set()  # replicas known to fill usage.prompt_tokens_details

    # -- the decision -----------------------------------------------------------------------
    async def route(
        self,
        parsed: ParsedRequest,
        *,
        request_id: str,
        session_header: str | None,
        api_key: str | None,
        pin: str | None = None,
    ) -> RouteDecision:
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
        per_prompt = min((n for n in (limit, max_model_len(model, replicas)) if n is not None), default=None)
        try:
            prompt = await self._tokenize(parsed, model, base, per_prompt)
        except PromptTooLong as exc:
            prompt_too_long(parsed, str(exc))
        if limit is not None and prompt.tokens > limit:
            prompt_too_long(parsed, f"prompt is {prompt.tokens} tokens long, more than the limit of {limit}")
        block_size = self.fleet.block_size(model)
        seed = namespace_seed(base, lora, salt)
        chains = tuple(self.chains.chain(data, block_size, seed) for data in prompt.data)
        route = RouteRequest(
            chain=chains[0],
            prompt_tokens=prompt.tokens,
            block_size=block_size,
            session_key=session_key,
            text=prompt.text,
            now=time.monotonic(),
        )
        load_key = f"{request_id}#{next(self._ids)}"  # client ids may repeat; load keys must not
        decision = await self.placement.place(route, self._snapshot(replicas), load_key, chains)
        self.metrics.decision(decision.reason)
        return RouteDecision(
            request_id=request_id,
            load_key=load_key,
            model=model,
            client=client_label(req.user, api_key),
            prompt=prompt,
            chains=chains,
            seed=seed,
            route=route,
            replica=decision.replica,
            reason=decision.reason,
            predicted_blocks=decision.matched_blocks,
            additions=additions,
        )

    def reroute(self, decision: RouteDecision) -> RouteDecision | None:
        """``decision.replica`` failed before the first byte: the next best replica's decision, or
        None when the attempts are spent or no other replica is eligible."""
        self.load.on_finished(decision.load_key)
        tried = (*decision.tried, decision.replica)
        if len(tried) > self.settings.retry_attempts:
            return None
        replicas = [r for r in self.fleet.eligible(decision.model) if r.name not in tried]
        if not replicas:
            return None
        chosen = self.placement.commit(decision.route, self._snapshot(replicas), decision.load_key, decision.chains)
        self.metrics.decision("failover")
        return replace(
            decision, replica=chosen.replica, reason="failover", predicted_blocks=chosen.matched_blocks, tried=tried
        )

    def _snapshot(self, replicas: Sequence[Replica]) -> list[ReplicaState]:
        return [snapshot(r.name, self.load, r.running) for r in replicas]

    def eligible(self, model: str) -> list[Replica]:
        """Replicas that may take a request for ``model``; 404 if none serves it, 503 if none is up."""
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
        raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    async def _tokenize(self, parsed: ParsedRequest, model: str, base: str, limit: int | None) -> Prompt:
        body = parsed.render_body
        # an adapter without a tokenizer of its own uses its base model's (else the default one)
        tok = self.tokenizers.get(model if model in self._explicit_tokenizers else base)
        want_text = self.policy.needs_text
        if parsed.kind != "completion":  # a chat, or a Responses request rendered as one
            messages = body["messages"]
            check_client_template(body, self.tokenizers.client_templates is not None)
            if tok is not None:
                try:
                    kwargs = {k: body[k] for k in _RENDER_FIELDS if k in body}
                    extra = body.get("chat_template_kwargs")
                    text = await tok.arender_chat(messages, client_templates=self.tokenizers.client_templates,
                                                  template_kwargs=extra if isinstance(extra, Mapping) else None, **kwargs)
                    add_special = bool(body.get("add_special_tokens", False))
                    encoded = await tok.aencode_bytes(text, add_special_tokens=add_special, max_tokens=limit)
                    return Prompt([encoded], len(encoded) // 4, text if want_text else "", exact=True)
                except ClientTemplateRefused as exc:
                    raise ApiError(exc.status, str(exc), param="chat_template", code=exc.code) from None
                except (TokenizerError, TypeError, ValueError) as exc:
                    log.debug("model %s: chat not rendered (%s); hashing its text instead", model, exc)
            self._warn_approximate(model, tok)
            text = chat_text(messages)
            data = approximate_token_bytes(text)
            return Prompt([data], len(data) // 4, text if want_text else "", exact=False)

        prompts = prompt_batch(body["prompt"])
        add_special = bool(body.get("add_special_tokens", True))
        if tok is not None and len(prompts) == 1 and isinstance(prompts[0], str):
            try:
                encoded = await tok.aencode_bytes(prompts[0], add_special_tokens=add_special, max_tokens=limit)
                return Prompt([encoded], len(encoded) // 4, prompts[0] if want_text else "", exact=True)
            except (TokenizerError, TypeError, ValueError) as exc:
                log.debug("model %s: prompt not tokenized (%s); hashing its text instead", model, exc)
        out: list[bytes] = []
        texts: list[str] = []
        exact = True
        for p in prompts:
            if isinstance(p, list):
                out.append(token_bytes(p))  # token ids: exact whatever the tokenizer
                continue
            texts.append(p)
            if tok is not None:
                try:
                    out.append(await tok.aencode_bytes(p, add_special_tokens=add_special, max_tokens=limit))
                    continue
                except (TokenizerError, TypeError, ValueError) as exc:
                    log.debug("model %s: prompt not tokenized (%s); hashing its text instead", model, exc)
            self._warn_approximate(model, tok)
            out.append(approximate_token_bytes(p))
            exact = False
        return Prompt(out, sum(len(data) for data in out) // 4, "\n".join(texts) if want_text else "", exact)

    def _warn_approximate(self, model: str, tok: object) -> None:
        if tok is None and model not in self._approx_warned:
            self._approx_warned.add(model)
            log.warning("no tokenizer configured for model %s: routing on approximate (byte) blocks", model)

    def forget_replica(self, name: str) -> None:
        """A replica left the fleet: it may come back under its name as another process."""
        self._reports_cached.discard(name)

    # -- what happened ----------------------------------------------------------------------
    def first_token(self, decision: RouteDecision, ttft_s: float) -> None:
        seen = self.load.on_first_token(decision.load_key, ttft_s, time.monotonic())
        if seen is not None:
            replica, uncached = seen
            self.policy.on_first_token(replica, uncached, ttft_s)
        self.metrics.model(decision.model).ttft.observe(ttft_s)

    def report(self, decision: RouteDecision, outcome: Outcome) -> None:
        """The request ended (answered, failed or abandoned): release its load, count it, and
        account its reuse once the answer is written (CPU work the client need not wait for)."""
        self.load.on_finished(decision.load_key)
        self.metrics.answered(decision.model, outcome.replica or decision.replica, outcome.status)
        if 200 <= outcome.status < 300:
            asyncio.get_running_loop().call_soon(self._account, decision, outcome)

    def _account(self, decision: RouteDecision, outcome: Outcome) -> None:
        """The hit-rate breakdown, for answered requests only: the figures share one denominator."""
        m = self.metrics.model(decision.model)
        block_size = decision.route.block_size
        tokens = decision.prompt.tokens
        m.prompt_tokens.inc(tokens)
        m.reuse_available.inc(self._observe_reuse(decision, decision.chains, decision.prompt.data) * block_size)
        m.reuse_predicted.inc(decision.predicted_blocks * block_size)
        cached = self.cached_tokens(outcome)
        if cached is not None:
            m.reuse_delivered.inc(cached)
            m.reuse_measured_prompt.inc(tokens)

    def cached_tokens(self, outcome: Outcome) -> int | None:
        """Cached prompt tokens the engine reported, or None if it does not report them.

        vLLM leaves ``prompt_tokens_details`` null when nothing was cached, and also when
        ``--enable-prompt-tokens-details`` is off; a replica that has reported details once has
        the flag on, so from then on its null means zero.
        """
        usage, replica = outcome.usage, outcome.replica
        if usage is None or replica is None:
            return None
        if usage.cached_tokens is not None:
            self._reports_cached.add(replica)
            return usage.cached_tokens
        return 0 if replica in self._reports_cached else None

    def _observe_reuse(self, decision: RouteDecision, chains: Sequence[list[int]], datas: Sequence[bytes]) -> int:
        """Available blocks over the batch; flags a cache-hostile prompt."""
        available = 0
        hostile = False
        block_size = decision.route.block_size
        for chain, data in zip(chains, datas):
            ids = np.frombuffer(data, dtype="<u4")
            seen = self.reuse.observe(decision.model, chain, ids, block_size, decision.seed)
            available += seen.available_blocks
            hostile = hostile or seen.cache_hostile
        if hostile:
            self.metrics.hostile(decision.client)
        return available
