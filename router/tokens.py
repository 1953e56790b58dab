"""Prompt tokenization for the router: a model's own tokenizer.json and chat template.

The router hashes the token ids the engine will see, so two things must match the engine exactly:

* the chat template is rendered as transformers renders it for vLLM (sandboxed Jinja with
  trim_blocks/lstrip_blocks, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``, the
  special tokens as variables; messages normalized as vLLM's chat parser does), and
* the rendered prompt is tokenized as vLLM tokenizes it (``add_special_tokens=False`` for chat,
  ``True`` for completions, with the post-processor transformers would install).

Speed on multi-turn traffic comes from how ``tokenizers`` encodes: its added-vocabulary pass first
cuts the input at every added token matched on the raw text (``normalized=False``, which special
tokens are), leftmost-longest, each lstrip/rstrip token absorbing the whitespace beside it; only
then does it normalize, pre-tokenize and run the model, on each piece between those tokens
separately.  A pre-tokenizer regex such as ``\\s+(?!\\S)`` therefore never looks across a special
token, and ByteLevel's ``add_prefix_space`` (either value) applies to every piece alike.  So the
ids of a prompt are the concatenation of the ids of its pieces, and a piece seen before (an
earlier turn of the conversation, a shared system prompt) is looked up instead of re-tokenized.
This is exact for byte-level BPE, with or without a prefix space, and for every step that treats
all pieces alike.  What is not (a Metaspace pre-tokenizer with ``prepend_scheme="first"``, which
prepends only to the piece at offset 0; single-word added tokens; BPE dropout;
``split_special_tokens``) falls back to whole-string encoding, and a self-check at load time
disables splitting if it ever disagrees with whole-string encoding on a probe.  The tests prove
equality with hypothesis on random chats and texts.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

# Before `tokenizers` is imported: its batch encoders otherwise queue every call on one shared
# rayon pool, so a short prompt encoded on the event loop waits behind long ones submitted from
# the thread pool (stalls of 0.15-2.4 s seen under concurrent long prompts).  Our own thread pool
# is the parallelism; each call then runs, GIL released, in the thread that made it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jinja2  # noqa: E402
import jinja2.ext  # noqa: E402
import jinja2.nodes  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402
from tokenizers import AddedToken  # noqa: E402
from tokenizers import Tokenizer as HfTokenizer  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

from .blocks import token_bytes  # noqa: E402

log = logging.getLogger(__name__)

ContentFormat = Literal["auto", "string", "openai"]

DEFAULT_CACHE_MAX_CHARS = 8_000_000
DEFAULT_CACHE_MAX_ENTRIES = 200_000
# Up to this many new characters are tokenized on the calling thread: a thread hop costs ~50-100
# microseconds, about what tokenizing a few hundred characters costs (a 16 KB prompt: milliseconds).
DEFAULT_INLINE_MAX_CHARS = 512

# Rust's `char::is_whitespace` / regex `\s` (Unicode White_Space), which tokenizers uses for the
# lstrip/rstrip of added tokens.  Python's str.isspace() differs (it also counts \x1c-\x1f).
_UNICODE_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"

# Segments' ids are kept as uint32 arrays where the machine's native layout is little-endian
# uint32: a prompt's token bytes (what block hashing reads) are then one C join of the cached
# arrays, instead of a list of thousands of ints built and converted on every request.
_U32_NATIVE = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _ids_array(ids: Iterable[int]) -> Sequence[int]:
    return array.array("I", ids) if _U32_NATIVE else tuple(ids)


# Text parts of a message's content that vLLM flattens into a string (vLLM's TEXT_PART_TYPES).
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Request-supplied template kwargs never choose the template nor replace the messages.
_UNSAFE_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "conversation")


class TokenizerError(Exception):
    """Base class of the errors of this module."""


class TokenizerLoadError(TokenizerError):
    """A tokenizer file exists but cannot be read or parsed."""


class TokenizerNotFoundError(TokenizerLoadError, FileNotFoundError):
    """The tokenizer directory or its tokenizer.json is missing."""


class ChatTemplateError(TokenizerError, ValueError):
    """The chat cannot be rendered: no template, invalid messages, or the template refused them."""


class UnsupportedContentError(ChatTemplateError):
    """A message holds non-text content (image, audio, ...): its tokens depend on the engine."""


# --------------------------------------------------------------------------------------------
# Segment cache


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    chars: int = 0


class SegmentCache:
    """Token ids of text segments, least recently used first out.

    Bounded by the total characters of the cached segments and by the number of entries; one lock
    guards it so the sync API may be called from several threads.
    """

    def __init__(self, max_chars: int = DEFAULT_CACHE_MAX_CHARS, max_entries: int = DEFAULT_CACHE_MAX_ENTRIES):
        if max_chars < 0 or max_entries < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_chars = max_chars
        self.max_entries = max_entries
        # A segment larger than this is not cached: it would flush most of the cache for one entry.
        self.max_segment_chars = max_chars // 4
        self._data: OrderedDict[str, Sequence[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, segment: str) -> bool:
        return segment in self._data

    @property
    def chars(self) -> int:
        return self._chars

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._stats.hits, self._stats.misses, self._stats.evictions, len(self._data), self._chars)

    def lookup(self, segments: Sequence[str]) -> list[Sequence[int] | None]:
        """The cached ids of each segment (None where absent); hits become most recently used."""
        data = self._data
        out: list[Sequence[int] | None] = []
        hits = 0
        with self._lock:
            for seg in segments:
                ids = data.get(seg)
                if ids is not None:
                    data.move_to_end(seg)
                    hits += 1
                out.append(ids)
            self._stats.hits += hits
            self._stats.misses += len(segments) - hits
        return out

    def store(self, segments: Sequence[str], ids_lists: Sequence[Sequence[int]]) -> None:
        data = self._data
        with self._lock:
            for seg, ids in zip(segments, ids_lists):
                size = len(seg)
                if size > self.max_segment_chars or self.max_entries == 0:
                    continue
                old = data.pop(seg, None)
                if old is not None:
                    self._chars -= size
                data[seg] = _ids_array(ids)
                self._chars += size
            while data and (self._chars > self.max_chars or len(data) > self.max_entries):
                seg, _ = data.popitem(last=False)
                self._chars -= len(seg)
                self._stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._chars = 0


# --------------------------------------------------------------------------------------------
# Splitting a prompt at added tokens, as tokenizers does


class _Splitter:
    """Cuts text where tokenizers' added-vocabulary pass cuts it (tokens matched on the raw text).

    ``split(text)`` returns ``[text_0, token_1, text_1, ..., token_n, text_n]``: the odd entries
    are added tokens (their ids are known), the even ones the text between them, which tokenizers
    encodes independently.  Matching is leftmost-longest like tokenizers' Aho-Corasick automaton
    (alternatives sorted longest first); lstrip/rstrip tokens absorb the adjacent whitespace as
    tokenizers does (rstrip of the left token first, then lstrip of the right one).
    """

    def __init__(self, tokens: Mapping[str, AddedToken]):
        self.ids: dict[str, int] = {}
        self._pattern: re.Pattern[str] | None = None
        self._lstrip = frozenset(c for c, t in tokens.items() if t.lstrip)
        self._rstrip = frozenset(c for c, t in tokens.items() if t.rstrip)
        if tokens:
            alternatives = sorted(tokens, key=lambda c: (-len(c), c))
            self._pattern = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

    def split(self, text: str) -> list[str]:
        if self._pattern is None:
            return [text]
        parts = self._pattern.split(text)
        if self._lstrip or self._rstrip:
            for i in range(1, len(parts), 2):
                tok = parts[i]
                if tok in self._rstrip:
                    parts[i + 1] = parts[i + 1].lstrip(_UNICODE_WHITESPACE)
                if tok in self._lstrip:
                    parts[i - 1] = parts[i - 1].rstrip(_UNICODE_WHITESPACE)
        return parts


def _unsafe_to_split(config: dict, split_tokens: Iterable[AddedToken], split_special_tokens: bool) -> str | None:
    """Why splitting at added tokens would not reproduce whole-string encoding, or None."""

    def walk(node: Any) -> Iterable[dict]:
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for comp in ("normalizer", "pre_tokenizer"):
        for node in walk(config.get(comp)):
            # Metaspace(prepend_scheme="first") prepends only to the piece at offset 0 of the input.
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return "Metaspace pre-tokenizer with prepend_scheme='first'"
    model = config.get("model") or {}
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout is random"
    tokens = list(split_tokens)
    if any(t.single_word for t in tokens):
        return "single_word added tokens (word-boundary rules)"
    if split_special_tokens:
        return "split_special_tokens is set"
    if any(t.lstrip or t.rstrip for t in tokens) and any(t.content != t.content.strip(_UNICODE_WHITESPACE) for t in tokens):
        return "added tokens that begin or end with whitespace next to lstrip/rstrip tokens"
    return None


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
def _compile_template(source: str) -> jinja2.Template:
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


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


# --------------------------------------------------------------------------------------------
# Loading


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc


def _pick_named_template(value: Any, tools: Any) -> str | None:
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

_shared_executor: ThreadPoolExecutor | None = None
_shared_executor_lock = threading.Lock()


def _default_executor() -> ThreadPoolExecutor:
    """One pool for every tokenizer of the process: tokenizing is CPU work, one thread per core."""
    global _shared_executor
    with _shared_executor_lock:
        if _shared_executor is None:
            _shared_executor = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="kvroute-tokenize")
        return _shared_executor


class Tokenizer:
    """One model's tokenizer and chat template, with a segment cache.

    Build it with :meth:`from_dir`.  Sync methods may be called from any thread; the async ones
    run large new segments on a thread pool (the batch encoders of ``tokenizers`` release the GIL;
    its plain ``encode`` does not, so it is not used).
    """

    def __init__(
        self,
        backend: HfTokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | list | None = None,
        content_format: ContentFormat = "auto",
        name: str = "",
        cache_max_chars: int = DEFAULT_CACHE_MAX_CHARS,
        cache_max_entries: int = DEFAULT_CACHE_MAX_ENTRIES,
        inline_max_chars: int = DEFAULT_INLINE_MAX_CHARS,
        executor: Executor | None = None,
    ):
        config = dict(config or {})
        self.name = name
        self.config = config
        self._backend = backend
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # transformers disables truncation and padding unless a call asks for them.
        backend.no_truncation()
        backend.no_padding()
        self.special_tokens: dict[str, Any] = {k: _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS if _token_content(config.get(k))}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, Mapping):  # transformers v5 may store named extra tokens
            extra = list(extra.values())
        extra_tokens = [c for c in (_token_content(t) for t in extra) if c]
        if extra_tokens:
            self.special_tokens["additional_special_tokens"] = extra_tokens
        self._add_missing_special_tokens(extra_tokens)
        split_special = bool(config.get("split_special_tokens", False))
        if split_special:
            backend.encode_special_tokens = True
        self._install_post_processor()

        # Added tokens matched on the raw text cut the input (normalized ones are matched later,
        # inside each piece, by tokenizers itself).
        added = {t.content: t for t in backend.get_added_tokens_decoder().values() if not t.normalized}
        self._splitter = _Splitter(added)
        self._token_ids = {c: backend.token_to_id(c) for c in added}
        self._token_arrays = {c: _ids_array((i,)) for c, i in self._token_ids.items()}
        reason = _unsafe_to_split(json.loads(backend.to_str()), added.values(), split_special)
        if reason is None:
            reason = self._self_check(list(added))
        if reason is not None:
            log.info("tokenizer %s: not splitting at special tokens (%s); whole prompts are encoded", name or "?", reason)
            self._splitter = _Splitter({})
        self.segmented = reason is None

        self._prefix, self._suffix = self._special_wrapping()
        self._chat_template = chat_template
        self.content_format = content_format
        self.model_max_length = config.get("model_max_length")
        self.cache = SegmentCache(cache_max_chars, cache_max_entries)
        self.inline_max_chars = inline_max_chars
        self._executor = executor

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, chat_template: str | os.PathLike[str] | None = None, **kwargs: Any) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (and a chat template file) from a directory.

        The chat template comes from, in order: the ``chat_template`` argument (template text, or a
        Path to a file, like vLLM's ``--chat-template``), ``chat_template.jinja``, a file named
        ``chat_template``, ``chat_template.json``, ``tokenizer_config.json``.
        """
        root = Path(path)
        if not root.is_dir():
            raise TokenizerNotFoundError(f"tokenizer directory {str(root)!r} does not exist (or is not a directory)")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            present = ", ".join(sorted(p.name for p in root.iterdir())[:20]) or "nothing"
            raise TokenizerNotFoundError(f"no tokenizer.json in {str(root)!r} (it holds: {present})")
        try:
            backend = HfTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config_file = root / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        template: Any = chat_template
        if isinstance(template, os.PathLike):
            try:
                template = Path(template).read_text(encoding="utf-8")
            except OSError as exc:
                raise TokenizerNotFoundError(f"cannot read chat template {str(chat_template)!r}: {exc}") from exc
        if template is None:
            for candidate in ("chat_template.jinja", "chat_template"):
                if (root / candidate).is_file():
                    template = (root / candidate).read_text(encoding="utf-8")
                    break
        if template is None and (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template")
        if template is None:
            template = config.get("chat_template")
        kwargs.setdefault("name", root.name)
        return cls(backend, config, chat_template=template, **kwargs)

    def _add_missing_special_tokens(self, extra_tokens: list[str]) -> None:
        """transformers adds the config's special tokens that tokenizer.json lacks; so do we."""
        present = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        decoder = self.config.get("added_tokens_decoder") or {}
        wanted: list[AddedToken] = []
        for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(spec, Mapping) and spec.get("content") and spec["content"] not in present:
                wanted.append(AddedToken(spec["content"], single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                                         rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", False), special=spec.get("special", True)))
        named = [v for k, v in self.special_tokens.items() if k != "additional_special_tokens"] + extra_tokens
        for content in named:
            if content not in present and all(t.content != content for t in wanted):
                wanted.append(AddedToken(content, special=True, normalized=False))
        if wanted:
            self._backend.add_tokens(wanted)  # keeps each token's own `special` flag

    def _install_post_processor(self) -> None:
        """transformers rebuilds the post-processor when the config sets add_bos/eos_token explicitly."""
        if "add_bos_token" not in self.config and "add_eos_token" not in self.config:
            return
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos = bool(self.config.get("add_bos_token")) and bos is not None
        add_eos = bool(self.config.get("add_eos_token")) and eos is not None
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
        specials = ([(bos, self._backend.token_to_id(bos))] if add_bos else []) + ([(eos, self._backend.token_to_id(eos))] if add_eos else [])
        self._backend.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def _special_wrapping(self) -> tuple[tuple[int, ...], tuple[int, ...]] | tuple[None, None]:
        """Ids the post-processor puts around a single sequence (e.g. BOS), found by a probe."""
        probe = "kvroute probe text"
        plain = self._backend.encode(probe, add_special_tokens=False).ids
        full = self._backend.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain) :])
        return None, None  # a post-processor that rewrites the sequence: encode whole prompts

    def _self_check(self, split_tokens: list[str]) -> str | None:
        if not split_tokens:
            return None
        sample = [" lead", "x  ", "\n\n", "tail  \n", " café 東京 ", "end"]
        text = "".join(s + split_tokens[i % len(split_tokens)] for i, s in enumerate(sample)) + "  last "
        whole = self._backend.encode(text, add_special_tokens=False).ids
        if self._encode_segments(text, use_cache=False) != whole:
            return "self-check: split encoding differs from whole-string encoding"
        return None

    # ---------------------------------------------------------------- chat rendering

    @property
    def chat_template(self) -> str | None:
        return _pick_named_template(self._chat_template, None)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the engine renders for these messages (vLLM + transformers rules).

        Extra keyword arguments and ``template_kwargs`` (a request's ``chat_template_kwargs``)
        become template variables.  As in vLLM, ``template_kwargs`` may also override
        add_generation_prompt, continue_final_message, tools and documents, but never the template.
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
        source = chat_template if chat_template is not None else _pick_named_template(self._chat_template, tools)
        if not source:
            raise ChatTemplateError(f"model {self.name!r} has no chat template (tokenizer_config.json has none, nor a chat_template.jinja file)")
        fmt = self.content_format if self.content_format != "auto" else detect_content_format(source)
        conversation = normalize_messages(messages, fmt)
        if tools is not None:
            if not isinstance(tools, (list, tuple)):
                raise ChatTemplateError("tools must be a list")
            tools = normalize_tools(tools)
        variables = {**self.special_tokens, **variables}
        template = _compile_template(source)
        try:
            rendered = template.render(messages=conversation, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template cannot render these messages: {exc!r}") from exc
        if continue_final_message:
            rendered = _strip_to_final_message(rendered, conversation)
        return rendered

    # ---------------------------------------------------------------- encoding

    def _plan(self, text: str) -> tuple[list[Any], list[str]]:
        """Split ``text``; return its parts (ids arrays, or a segment string still to encode) and
        the distinct new segments."""
        pieces = self._splitter.split(text)
        cached = iter(self.cache.lookup([seg for seg in pieces[0::2] if seg]))
        parts: list[Any] = []
        missing: dict[str, None] = {}  # ordered set
        ids_of = self._token_arrays
        for i, piece in enumerate(pieces):
            if i % 2:
                parts.append(ids_of[piece])
            elif piece:
                ids = next(cached)
                if ids is None:
                    missing[piece] = None
                    parts.append(piece)
                else:
                    parts.append(ids)
        return parts, list(missing)

    def _encode_new(self, segments: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encode_batch(segments, add_special_tokens=False)]

    def _assemble(self, parts: list[Any], missing: list[str], encoded: list[list[int]], use_cache: bool = True) -> list[int]:
        if missing and use_cache:
            self.cache.store(missing, encoded)
        new = dict(zip(missing, encoded))
        out: list[int] = []
        for part in parts:
            out.extend(new[part] if isinstance(part, str) else part)
        return out

    def _encode_segments(self, text: str, use_cache: bool = True) -> list[int]:
        if not use_cache:
            pieces = self._splitter.split(text)
            segs = [s for s in pieces[0::2] if s]
            new = dict(zip(segs, self._encode_new(segs))) if segs else {}
            out: list[int] = []
            for i, piece in enumerate(pieces):
                out.extend(new.get(piece, ()) if i % 2 == 0 else (self._token_ids[piece],))
            return out
        parts, missing = self._plan(text)
        return self._assemble(parts, missing, self._encode_new(missing) if missing else [])

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens or not (self._prefix or self._suffix):
            return ids
        return [*self._prefix, *ids, *self._suffix]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, equal to ``tokenizer.json``'s whole-string encoding."""
        if add_special_tokens and self._prefix is None:
            return self._backend.encode_batch([text], add_special_tokens=True)[0].ids
        return self._wrap(self._encode_segments(text), add_special_tokens)

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: special tokens added as the engine adds them (BOS if configured)."""
        return self.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], /, *, add_special_tokens: bool = False, **render_kwargs: Any) -> list[int]:
        """A chat's ids: the rendered prompt tokenized with ``add_special_tokens=False`` (vLLM's default)."""
        return self.encode(self.render_chat(messages, **render_kwargs), add_special_tokens=add_special_tokens)

    async def aencode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``encode`` that never blocks the event loop on a long new segment."""
        if add_special_tokens and self._prefix is None:
            return await self._in_pool(lambda: self._backend.encode_batch([text], add_special_tokens=True)[0].ids)
        parts, missing = self._plan(text)
        encoded = await self._aencode_new(missing)
        return self._wrap(self._assemble(parts, missing, encoded), add_special_tokens)

    async def aencode_bytes(self, text: str, *, add_special_tokens: bool = False) -> bytes:
        """``aencode``'s ids as uint32 little-endian bytes (what block hashing reads), joined in C
        from the cached segments' arrays: no list of ints is built nor converted."""
        if not _U32_NATIVE or (add_special_tokens and self._prefix is None):
            return token_bytes(await self.aencode(text, add_special_tokens=add_special_tokens))
        parts, missing = self._plan(text)
        encoded = [_ids_array(ids) for ids in await self._aencode_new(missing)]
        if missing:
            self.cache.store(missing, encoded)
        new = dict(zip(missing, encoded))
        pieces = [new[part] if isinstance(part, str) else part for part in parts]
        if add_special_tokens:
            pieces = [_ids_array(self._prefix or ()), *pieces, _ids_array(self._suffix or ())]
        return b"".join(pieces)

    async def _aencode_new(self, missing: list[str]) -> list[list[int]]:
        """New segments' ids: on this thread when short, else on the pool (the loop stays free)."""
        if not missing:
            return []
        if sum(map(len, missing)) <= self.inline_max_chars:
            return self._encode_new(missing)
        return await self._in_pool(lambda: self._encode_new(missing))

    async def aencode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.aencode(text, add_special_tokens=add_special_tokens)

    async def aencode_chat(self, messages: Sequence[Mapping[str, Any]], /, *, add_special_tokens: bool = False, **render_kwargs: Any) -> list[int]:
        # Rendering is Python (holds the GIL): a thread would not make it cheaper, so it stays here.
        return await self.aencode(self.render_chat(messages, **render_kwargs), add_special_tokens=add_special_tokens)

    async def _in_pool(self, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor or _default_executor(), fn)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- introspection

    @property
    def backend(self) -> HfTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (post-processor as transformers would set it)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, segmented={self.segmented}, cached={len(self.cache)})"


class TokenizerRegistry:
    """Which tokenizer each model uses: explicit per-model directories, else an optional default.

    Models that share a directory share one :class:`Tokenizer` (and its cache), e.g. LoRA adapters
    served under their own names on one base model.
    """

    def __init__(self, by_model: Mapping[str, Tokenizer] | None = None, default: Tokenizer | None = None):
        self._by_model = dict(by_model or {})
        self.default = default

    @classmethod
    def from_config(
        cls,
        dirs: Mapping[str, str | os.PathLike[str]] | None = None,
        default_dir: str | os.PathLike[str] | None = None,
        **tokenizer_kwargs: Any,
    ) -> TokenizerRegistry:
        """Load every configured directory now, so a bad path fails at startup, not on a request."""
        loaded: dict[Path, Tokenizer] = {}

        def load(path: str | os.PathLike[str]) -> Tokenizer:
            key = Path(path).resolve()
            if key not in loaded:
                loaded[key] = Tokenizer.from_dir(key, **tokenizer_kwargs)
            return loaded[key]

        by_model = {model: load(path) for model, path in (dirs or {}).items()}
        default = load(default_dir) if default_dir is not None else None
        return cls(by_model, default)

    def get(self, model: str) -> Tokenizer | None:
        """The model's tokenizer, the default one, or None when the router has none for it."""
        return self._by_model.get(model, self.default)

    def __getitem__(self, model: str) -> Tokenizer:
        tok = self.get(model)
        if tok is None:
            raise KeyError(f"no tokenizer configured for model {model!r} (and no default tokenizer)")
        return tok

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self.get(model) is not None

    def models(self) -> list[str]:
        """Models with an explicitly configured tokenizer."""
        return sorted(self._by_model)

    def tokenizers(self) -> list[Tokenizer]:
        """Each distinct tokenizer once."""
        seen: dict[int, Tokenizer] = {}
        for tok in [*self._by_model.values(), *([self.default] if self.default else [])]:
            seen.setdefault(id(tok), tok)
        return list(seen.values())
