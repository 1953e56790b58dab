"""A request's prompt: its token ids as the engine will see them, the router's first step.

Every prompt is routed on its whole token ids: the decision, the load it charges and the
prediction it records all need the prompt's real length and chain (docs/design.md §1 says why a
prompt is never routed on an estimate of its head).

Tokens: the model's own tokenizer and chat template when one is configured (exact block
hashes).  Without one the router still routes cache-aware, approximately: the prompt's UTF-8
bytes are cut into 4-byte words used as pseudo tokens (about one real token each in English), so
equal text prefixes still give equal chains, only the block boundaries differ from the engine's.
A chat whose template cannot be rendered (images, a template that rejects the messages) uses the
same approximation and lets the engine give its own verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from kvroute.common.blocks import token_bytes
from kvroute.common.errors import ApiError
from kvroute.common.requests import ParsedRequest, prompt_batch
from kvroute.common.tokens import ClientTemplateRefused, Tokenizer, TokenizerError, TokenizerRegistry

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


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the router computed from the request body."""

    data: tuple[bytes, ...]  # per prompt of the batch: its token ids as uint32 little-endian bytes
    tokens: int
    text: str
    exact: bool  # tokenized with the model's own tokenizer


class PromptBuilder:
    """Renders and tokenizes a request's prompt with its model's tokenizer (or approximates it)."""

    def __init__(self, tokenizers: TokenizerRegistry, *, want_text: bool):
        self.tokenizers = tokenizers
        self.want_text = want_text  # the policy matches text (Policy.needs_text): keep the prompt's
        self._explicit_tokenizers = set(tokenizers.models())
        self._approx_warned: set[str] = set()

    def tokenizer(self, model: str, base: str) -> Tokenizer | None:
        """The tokenizer of ``model``: its own, else (an adapter) its base model's, else the default."""
        return self.tokenizers.get(model if model in self._explicit_tokenizers else base)

    async def build(self, parsed: ParsedRequest, model: str, base: str, limit: int | None) -> Prompt:
        """The request's prompt: its tokens as the model's engine will see them (``limit``: at most
        that many per prompt, else :class:`PromptTooLong`), else approximate ones."""
        body = parsed.render_body
        tok = self.tokenizer(model, base)
        want_text = self.want_text
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
                    return Prompt((encoded,), len(encoded) // 4, text if want_text else "", exact=True)
                except ClientTemplateRefused as exc:
                    raise ApiError(exc.status, str(exc), param="chat_template", code=exc.code) from None
                except (TokenizerError, TypeError, ValueError) as exc:
                    log.debug("model %s: chat not rendered (%s); hashing its text instead", model, exc)
            self._warn_approximate(model, tok)
            text = chat_text(messages)
            data = approximate_token_bytes(text)
            return Prompt((data,), len(data) // 4, text if want_text else "", exact=False)

        prompts = prompt_batch(body["prompt"])
        add_special = bool(body.get("add_special_tokens", True))
        if tok is not None and len(prompts) == 1 and isinstance(prompts[0], str):
            try:
                encoded = await tok.aencode_bytes(prompts[0], add_special_tokens=add_special, max_tokens=limit)
                return Prompt((encoded,), len(encoded) // 4, prompts[0] if want_text else "", exact=True)
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
        return Prompt(tuple(out), sum(len(data) for data in out) // 4, "\n".join(texts) if want_text else "", exact)

    def _warn_approximate(self, model: str, tok: object) -> None:
        if tok is None and model not in self._approx_warned:
            self._approx_warned.add(model)
            log.warning("no tokenizer configured for model %s: routing on approximate (byte) blocks", model)
