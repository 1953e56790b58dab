"""Chat templates, rendered as transformers renders them for vLLM.

A sandboxed Jinja environment with trim_blocks/lstrip_blocks, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson`` and the ``{% generation %}`` tag; messages and tools
normalized as vLLM's chat parser does.  :func:`prepare_render` checks a request's messages and
options into a :class:`RenderJob` (plain data: it can cross to a worker process) and
:func:`render` renders one; it imports no tokenizer, so the client-template worker stays light.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvroute.common.tokens.errors import ChatTemplateError, UnsupportedContentError

ContentFormat = Literal["auto", "string", "openai"]

# Text parts of a message's content that vLLM flattens into a string (vLLM's TEXT_PART_TYPES).
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
# Request-supplied template kwargs never choose the template nor replace the messages.
_UNSAFE_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "conversation")

# --------------------------------------------------------------------------------------------
# Chat template: rendered as transformers renders it


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes and sorts keys.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """vLLM's sandbox, with its per-access safety verdict remembered.

    The sandbox asks ``is_safe_attribute`` on every attribute a template reads (``message.get``
    on each message, each render); the verdict depends only on the object's type and the
    attribute's name (``is_internal_attribute`` and ``modifies_known_mutable`` test both and
    nothing else), so it is computed once per pair.
    """

    _MAX_VERDICTS = 4096  # names come from templates; a bound all the same

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < self._MAX_VERDICTS:
                self._verdicts[key] = verdict
        return verdict


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """A template compiled in vLLM's sandbox (cached: a model's few templates are compiled once)."""
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
    # Jinja keeps a template's globals as a ChainMap over the environment's and copies it into a
    # dict on every render (a third of a one-line chat's render): these never change, flatten once
    template.globals = dict(template.globals)
    return template


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> Literal["string", "openai"]:
    """vLLM's 'auto' rule, simplified: 'openai' if the template loops over a message's content."""
    env = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) and it.arg.value == "content":
            return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def _text_parts(parts: Iterable[Any]) -> list[str]:
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"a content part must be an object or a string, not {type(part).__name__}")
        kind = part.get("type", "text")
        if kind not in _TEXT_PART_TYPES:
            raise UnsupportedContentError(f"content part of type {kind!r} is not text")
        text = part.get(kind if kind in ("refusal", "thinking") else "text")
        if text is None:  # vLLM skips a text part without text
            continue
        if not isinstance(text, str):
            raise ChatTemplateError(f"the text of a {kind!r} content part must be a string")
        texts.append(text)
    return texts


def normalize_messages(messages: Sequence[Mapping[str, Any]], content_format: Literal["string", "openai"]) -> list[dict]:
    """Messages as vLLM hands them to the template (vLLM's chat parser, text-only).

    Content: None -> "", a string stays, text parts are joined with "\\n" ('string' format) or kept
    as ``[{"type": "text", "text": …}]`` ('openai' format, where a string becomes one part).  Only the
    fields vLLM keeps are passed: role, content, name; assistant tool_calls (arguments decoded
    from JSON, empty lists dropped) and reasoning; a tool message's tool_call_id.
    """
    out = []
    plain = content_format == "string"
    for message in messages:
        # the common message, {"role": "...", "content": "..."}: nothing to flatten or carry over
        if plain and type(message) is dict and len(message) == 2:
            role, content = message.get("role"), message.get("content")
            if type(role) is str and type(content) is str:
                out.append({"role": role, "content": content})
                continue
        if not isinstance(message, Mapping):
            raise ChatTemplateError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError("each message needs a string 'role'")
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, (list, tuple)):
            parts = list(content)
        else:
            raise ChatTemplateError("message content must be a string, a list of parts, or null")
        texts = _text_parts(parts)
        if content_format == "openai" and role != "tool":  # vLLM flattens text-only tool results
            msg: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            msg = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise ChatTemplateError("tool_calls must be a list")
                if calls:
                    msg["tool_calls"] = [_decode_tool_call(call) for call in calls]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        out.append(msg)
    return out


def normalize_tools(tools: Sequence[Any]) -> list[dict]:
    """Tools as vLLM hands them to the template: its pydantic models dumped, so a function's
    missing ``description``/``parameters`` become null and declared fields come first."""
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ChatTemplateError("each tool must be an object")
        if tool.get("type", "function") != "function":
            out.append(dict(tool))
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError("a function tool needs a 'function' object with a string 'name'")
        dumped_function = {"name": function["name"], "description": function.get("description"), "parameters": function.get("parameters")}
        dumped_function.update((k, v) for k, v in function.items() if k not in dumped_function)
        dumped = {"type": "function", "function": dumped_function}
        dumped.update((k, v) for k, v in tool.items() if k not in dumped)
        out.append(dumped)
    return out


def _decode_tool_call(call: Any) -> dict:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError("each tool call needs a 'function' object")
    call = deepcopy(dict(call))
    function = call["function"] = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif not isinstance(arguments, (dict, list)):
        try:
            function["arguments"] = json.loads(arguments)
        except (TypeError, ValueError) as exc:
            raise ChatTemplateError(f"tool call arguments are not valid JSON: {exc}") from exc
    return call


def _strip_to_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """transformers' continue_final_message: cut the prompt right after the last message's text."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    final = messages[-1].get("content")
    if isinstance(final, (list, tuple)):
        texts = [p["text"] for p in final if isinstance(p, Mapping) and "text" in p]
        if not texts:
            raise ChatTemplateError("continue_final_message is set but the final message has no text")
        final = texts[-1]
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the rendered chat")
    loc = rendered.rindex(final.strip())
    if rendered[loc : loc + len(final.lstrip())] == final:
        return rendered[: loc + len(final.lstrip())]
    return rendered[: loc + len(final.strip())]


def pick_named_template(value: Any, tools: Any) -> str | None:
    """A chat_template entry: a string, or transformers' list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"no 'default' among the named chat templates {sorted(map(str, named))}")
    raise ChatTemplateError("chat_template must be a string or a list of named templates")



# --------------------------------------------------------------------------------------------
# One render: resolved from a request's options, then rendered (here or in the client-template worker)


@dataclass
class RenderJob:
    """A chat to render, as plain data (it crosses to the client-template worker as msgpack)."""

    source: str
    messages: list[Any]  # as the request gave them; normalized by render()
    content_format: ContentFormat
    add_generation_prompt: bool
    continue_final_message: bool
    tools: Any
    documents: Any
    variables: dict[str, Any]


def prepare_render(
    messages: Sequence[Mapping[str, Any]],
    model_template: str | list | None,
    *,
    client_template: str | None,
    model_name: str,
    content_format: ContentFormat,
    special_tokens: Mapping[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Any,
    documents: Any,
    template_kwargs: Mapping[str, Any] | None,
    kwargs: Mapping[str, Any],
) -> RenderJob:
    """Resolve a request's options into a job, cheaply (no parsing, no copying of the messages).

    The template is the client's when given, else the model's (a named list picks 'tool_use'
    when there are tools).

    ``template_kwargs`` (a request's ``chat_template_kwargs``) and ``kwargs`` become template
    variables; as in vLLM they may override add_generation_prompt, continue_final_message, tools
    and documents, but never the template nor the messages.
    """
    variables = {**kwargs, **(template_kwargs or {})}
    add_generation_prompt = bool(variables.pop("add_generation_prompt", add_generation_prompt))
    continue_final_message = bool(variables.pop("continue_final_message", continue_final_message))
    tools = variables.pop("tools", tools)
    documents = variables.pop("documents", documents)
    for name in _UNSAFE_TEMPLATE_KWARGS:
        variables.pop(name, None)
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be set")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list")
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list")
    source = client_template if client_template is not None else pick_named_template(model_template, tools)
    if not source:
        raise ChatTemplateError(f"model {model_name!r} has no chat template (tokenizer_config.json has none, nor a chat_template.jinja file)")
    return RenderJob(source, list(messages), content_format, add_generation_prompt, continue_final_message,
                     tools, documents, {**special_tokens, **variables})


class OutputTooLarge(ChatTemplateError):
    """A template rendered more than its output budget."""


def render(job: RenderJob, template: jinja2.Template | None = None, *, max_chars: int | None = None) -> str:
    """The prompt text of ``job`` (vLLM + transformers rules); ``max_chars`` stops a template
    that writes more than that as soon as it has."""
    fmt = job.content_format if job.content_format != "auto" else detect_content_format(job.source)
    conversation = normalize_messages(job.messages, fmt)
    tools = normalize_tools(job.tools) if job.tools is not None else None
    template = template or compile_template(job.source)
    context = {**job.variables, "messages": conversation, "tools": tools, "documents": job.documents,
               "add_generation_prompt": job.add_generation_prompt}
    try:
        if max_chars is None:
            rendered = template.render(context)
        else:
            rendered = _render_bounded(template, context, max_chars)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        if isinstance(exc, ChatTemplateError):
            raise
        raise ChatTemplateError(f"chat template cannot render these messages: {exc!r}") from exc
    if job.continue_final_message:
        rendered = _strip_to_final_message(rendered, conversation)
    return rendered


def _render_bounded(template: jinja2.Template, context: dict[str, Any], max_chars: int) -> str:
    chunks: list[str] = []
    size = 0
    for chunk in template.generate(context):
        size += len(chunk)
        if size > max_chars:
            raise OutputTooLarge(f"the chat template rendered more than {max_chars} characters")
        chunks.append(chunk)
    return "".join(chunks)


def chat_size(messages: Sequence[Any]) -> int:
    """About what rendering these messages costs, in characters (a message counts as 200); a
    long list is not walked (that walk would cost what it measures)."""
    if len(messages) > 256:
        return 200 * len(messages)
    size = 0
    for message in messages:
        size += 200
        # a dict is a Mapping: checked first, as an ABC's isinstance costs most of this walk
        content = message.get("content") if type(message) is dict or isinstance(message, Mapping) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += 200 * len(content) + sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return size
