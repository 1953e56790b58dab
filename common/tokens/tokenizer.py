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

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before `tokenizers` is imported: its batch encoders otherwise queue every call on one shared
# rayon pool, so a short prompt encoded on the event loop waits behind long ones submitted from
# the thread pool (stalls of 0.15-2.4 s seen under concurrent long prompts).  Our own thread pool
# is the parallelism; each call then runs, GIL released, in the thread that made it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer as HfTokenizer  # noqa: E402

from kvroute.common.tokens.bounds import chat_tokens_at_least, max_chars_per_token, probe_message_tokens  # noqa: E402
from kvroute.common.tokens.chat_template import (  # noqa: E402
    ContentFormat,
    RenderJob,
    chat_size,
    compile_template,
    detect_content_format,
    pick_named_template,
    prepare_render,
    render,
)
from kvroute.common.tokens.client_templates import ClientTemplates  # noqa: E402
from kvroute.common.tokens.errors import ChatTemplateError, PromptTooLong  # noqa: E402
from kvroute.common.tokens.loading import add_missing_special_tokens, install_post_processor, read_dir, special_tokens_of  # noqa: E402
from kvroute.common.tokens.long_text import encode_long, is_long  # noqa: E402
from kvroute.common.tokens.memory import release_free_memory  # noqa: E402
from kvroute.common.tokens.segments import (  # noqa: E402
    DEFAULT_CACHE_MAX_CHARS,
    DEFAULT_CACHE_MAX_ENTRIES,
    SegmentCache,
    Splitter,
    ids_array,
    to_bytes,
    unsafe_to_split,
)

log = logging.getLogger(__name__)

# Up to this many new characters are tokenized on the calling thread: a thread hop costs ~50-100
# microseconds, about what tokenizing a few hundred characters costs (a 16 KB prompt: milliseconds).
DEFAULT_INLINE_MAX_CHARS = 512
# A longer text is cut and looked up on the pool as well (a regex split over 64 K chars: ~1 ms).
PLAN_INLINE_MAX_CHARS = 65_536
# A chat of up to about this many characters renders on the loop (~1 ms); a larger one on the pool.
RENDER_INLINE_MAX_CHARS = 65_536
# Length checks tokenize prefixes of at least this many characters (smaller texts are just encoded).
PROBE_MIN_CHARS = 65_536
# After tokenizing a text this long, free heap goes back to the OS (tokenizers' transient buffers,
# ~100 bytes a character per chunk, stay in glibc's arenas otherwise: RSS that never comes back).
TRIM_AFTER_CHARS = 1_000_000


@dataclass
class _Plan:
    """A text cut into parts: ids arrays, and segments (str) still to encode, listed in ``missing``."""

    parts: list[Any]
    missing: list[str]
    whole: bool = False  # one whole-string encode, special tokens included
    wrap: bool = False  # put the post-processor's special tokens around the parts
    use_cache: bool = True


def _as_list(pieces: list[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for piece in pieces:
        out.extend(piece)
    return out


_shared_executor: ThreadPoolExecutor | None = None
_shared_executor_lock = threading.Lock()


_pool_jobs = 0  # jobs handed to a tokenizer pool and not finished, every tokenizer of the process


def pool_backlog() -> int:
    """Tokenizer jobs waiting for a thread (handed over, not started: beyond one per core).  The
    router reads it as one sign of its own saturation (router/edge/overload/saturation.py)."""
    return max(0, _pool_jobs - (os.cpu_count() or 2))


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
        self.special_tokens, extra_tokens = special_tokens_of(config)
        add_missing_special_tokens(backend, config, self.special_tokens, extra_tokens)
        split_special = bool(config.get("split_special_tokens", False))
        if split_special:
            backend.encode_special_tokens = True
        install_post_processor(backend, config, self.special_tokens)

        # Added tokens matched on the raw text cut the input (normalized ones are matched later,
        # inside each piece, by tokenizers itself).
        added = {t.content: t for t in backend.get_added_tokens_decoder().values() if not t.normalized}
        self._splitter = Splitter(added)
        self._token_ids = {c: backend.token_to_id(c) for c in added}
        self._token_arrays = {c: ids_array((i,)) for c, i in self._token_ids.items()}
        backend_config = json.loads(backend.to_str())
        reason = unsafe_to_split(backend_config, added.values(), split_special)
        if reason is None:
            reason = self._self_check(list(added))
        if reason is not None:
            log.info("tokenizer %s: not splitting at special tokens (%s); whole prompts are encoded", name or "?", reason)
            self._splitter = Splitter({})
        self.segmented = reason is None

        self._prefix, self._suffix = self._special_wrapping()
        self._chat_template = chat_template
        self._warm_templates()
        self.content_format = content_format
        # lower bounds on a prompt's tokens before it is tokenized (bounds.py): characters a token
        # stands for at most (None: no bound), special tokens a message of each role adds at least
        self.max_chars_per_token = max_chars_per_token(backend_config, added)
        self._specials = Splitter(added)  # counts special tokens even where prompts are not split
        self.message_tokens = probe_message_tokens(self._render_probe, self._count_specials)
        self.model_max_length = config.get("model_max_length")
        self.cache = SegmentCache(cache_max_chars, cache_max_entries)
        self.inline_max_chars = inline_max_chars
        self._executor = executor

    # ---------------------------------------------------------------- construction

    @classmethod
    def load(cls, spec: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
        """A tokenizer from a directory or a Hugging Face model id (:mod:`kvroute.common.tokens.hub`)."""
        from kvroute.common.tokens.hub import hub_model_id, tokenizer_dir

        if hub_model_id(spec) is not None:
            kwargs.setdefault("name", str(spec))
        return cls.from_dir(tokenizer_dir(spec), **kwargs)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, chat_template: str | os.PathLike[str] | None = None, **kwargs: Any) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (and a chat template file) from a
        directory; :func:`kvroute.common.tokens.loading.read_dir` says where the template comes from."""
        backend, config, template = read_dir(path, chat_template)
        kwargs.setdefault("name", Path(path).name)
        return cls(backend, config, chat_template=template, **kwargs)

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
        if _as_list(self._pieces(text, False, use_cache=False)) != whole:
            return "self-check: split encoding differs from whole-string encoding"
        return None

    def _render_probe(self, messages: list[dict[str, str]]) -> str:
        return self.render_chat(messages, add_generation_prompt=False)

    def _count_specials(self, text: str) -> int:
        return len(self._specials.split(text)) // 2

    def chat_tokens_at_least(self, roles: Sequence[Any]) -> int:
        """A lower bound on the tokens of a chat with messages of these roles, rendered with the
        model's own template (bounds.py): no rendering, no tokenizing."""
        return chat_tokens_at_least(self.message_tokens, roles)

    # ---------------------------------------------------------------- chat rendering

    @property
    def chat_template(self) -> str | None:
        return pick_named_template(self._chat_template, None)

    def _warm_templates(self) -> None:
        """Compile the model's templates now: the first request would otherwise compile on the
        event loop (~100 ms for a typical template).  One that does not compile fails as before,
        on the requests that use it."""
        named = self._chat_template if isinstance(self._chat_template, list) else [{"template": self._chat_template}]
        for entry in named:
            source = entry.get("template") if isinstance(entry, Mapping) else None
            if isinstance(source, str) and source:
                try:
                    compile_template(source)
                    detect_content_format(source)
                except ChatTemplateError as exc:
                    log.warning("tokenizer %s: its chat template does not compile: %s", self.name or "?", exc)

    def prepare_chat(
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
    ) -> RenderJob:
        """What :meth:`render_chat` renders, checked and resolved (cheap: nothing parsed yet)."""
        return prepare_render(
            messages, self._chat_template, client_template=chat_template, model_name=self.name,
            content_format=self.content_format, special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, documents=documents, template_kwargs=template_kwargs, kwargs=kwargs,
        )

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> str:
        """The prompt text the engine renders for these messages (vLLM + transformers rules).

        Options: add_generation_prompt, continue_final_message, tools, documents, chat_template
        (a template to use instead of the model's), template_kwargs (a request's
        ``chat_template_kwargs``) and any other keyword, which become template variables.  As in
        vLLM, ``template_kwargs`` may override the first four but never the template.
        """
        return render(self.prepare_chat(messages, **options))

    async def arender_chat(
        self, messages: Sequence[Mapping[str, Any]], /, *, client_templates: ClientTemplates | None = None, **options: Any
    ) -> str:
        """:meth:`render_chat` that keeps the event loop free: a ``chat_template`` given here goes
        to ``client_templates``' worker process when one is given (time and size budgets), and a
        large chat renders on the thread pool."""
        job = self.prepare_chat(messages, **options)
        if options.get("chat_template") is not None and client_templates is not None:
            return await client_templates.render(job)
        if chat_size(job.messages) <= RENDER_INLINE_MAX_CHARS:
            return render(job)
        return await self._in_pool(lambda: render(job))

    # ---------------------------------------------------------------- encoding
    # One path for every variant (sync or async, ids or bytes): _plan cuts the text at added tokens
    # and looks its pieces up in the cache; _encode_new tokenizes the new ones (here or on the
    # pool); _join caches them and concatenates the pieces, special tokens around them if asked.

    def _plan(self, text: str, add_special_tokens: bool, use_cache: bool = True) -> _Plan:
        if add_special_tokens and self._prefix is None:
            return _Plan([text], [text], whole=True)  # a post-processor that rewrites the sequence
        pieces = self._splitter.split(text)
        segments = [seg for seg in pieces[0::2] if seg]
        cached = iter(self.cache.lookup(segments) if use_cache else [None] * len(segments))
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
        return _Plan(parts, list(missing), wrap=add_special_tokens, use_cache=use_cache)

    def _encode_new(self, plan: _Plan, max_tokens: int | None = None) -> list[Sequence[int]]:
        """The ids of the plan's new segments (the batch encoder: it releases the GIL); a very
        long one in chunks, stopping past ``max_tokens`` (see long_text.py)."""
        if not plan.missing:
            return []
        if plan.whole:
            return [ids_array(e.ids) for e in self._encode_batch(plan.missing, add_special_tokens=True)]
        short = [seg for seg in plan.missing if not is_long(seg)]
        ids_of = dict(zip(short, (ids_array(e.ids) for e in self._encode_plain(short)))) if short else {}
        for seg in plan.missing:
            if seg not in ids_of:
                ids_of[seg] = encode_long(self._encode_plain, seg, max_tokens)
        return [ids_of[seg] for seg in plan.missing]

    def _encode_plain(self, texts: list[str]) -> Sequence[Any]:
        return self._encode_batch(texts, add_special_tokens=False)

    def _join(self, plan: _Plan, encoded: list[Sequence[int]]) -> list[Sequence[int]]:
        if plan.whole:
            return encoded
        if encoded and plan.use_cache:
            self.cache.store(plan.missing, encoded)
        new = dict(zip(plan.missing, encoded))
        pieces = [new[part] if isinstance(part, str) else part for part in plan.parts]
        if plan.wrap and (self._prefix or self._suffix):
            pieces = [ids_array(self._prefix or ()), *pieces, ids_array(self._suffix or ())]
        return pieces

    def _pieces(
        self, text: str, add_special_tokens: bool, max_tokens: int | None = None, use_cache: bool = True,
        plan: _Plan | None = None,
    ) -> list[Sequence[int]]:
        """The ids of ``text`` as a list of arrays, on this thread (``plan``: the text's, if made)."""
        try:
            if max_tokens is not None and not self.segmented:
                self._check_length(text, max_tokens)  # its seams rarely verify: no chunks to count on
            if plan is None:
                plan = self._plan(text, add_special_tokens, use_cache)
            return self._join(plan, self._encode_new(plan, max_tokens))
        finally:
            if len(text) >= TRIM_AFTER_CHARS:
                release_free_memory()

    async def _apieces(
        self, text: str, add_special_tokens: bool, max_tokens: int | None, plan: _Plan | None = None
    ) -> list[Sequence[int]]:
        """:meth:`_pieces`, keeping the event loop free: a long text is cut and looked up on the
        pool too (the regex split and the joins of a megabyte prompt take milliseconds)."""
        if max_tokens is not None and self.max_chars_per_token is not None:
            at_least = -(-len(text) // self.max_chars_per_token)
            if at_least > max_tokens:  # refused without tokenizing a character (bounds.py)
                raise PromptTooLong(at_least, max_tokens, at_least=True)
        if len(text) > PLAN_INLINE_MAX_CHARS:
            pieces = await self._in_pool(lambda: self._pieces(text, add_special_tokens, max_tokens, plan=plan))
        else:
            if plan is None:
                plan = self._plan(text, add_special_tokens)
            if sum(map(len, plan.missing)) <= self.inline_max_chars:
                encoded = self._encode_new(plan)
            else:
                encoded = await self._in_pool(lambda: self._encode_new(plan))
            pieces = self._join(plan, encoded)
        if max_tokens is not None and (n := sum(map(len, pieces))) > max_tokens:
            raise PromptTooLong(n, max_tokens, at_least=False)
        return pieces

    def _check_length(self, text: str, max_tokens: int) -> None:
        """PromptTooLong when ``text`` is over ``max_tokens``, found on growing prefixes of it so
        that a huge prompt costs what a few times the limit costs, not what its whole length would.

        A prefix's ids are the whole text's ids up to the cut, but for the last few tokens at
        the cut: a prefix over the limit by a margin proves the whole is over it.
        """
        size = max(PROBE_MIN_CHARS, 4 * max_tokens)
        while size < len(text):
            n = len(self._encode_batch([text[:size]], add_special_tokens=False)[0])
            if n > max_tokens * 1.05 + 64:
                raise PromptTooLong(n, max_tokens, at_least=True)
            size *= 2  # doubling: at most ~2x the work, and the last probe at most ~2x what it needed
        # the whole text is encoded next; its exact count is checked by the caller's limit

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, equal to ``tokenizer.json``'s whole-string encoding."""
        return _as_list(self._pieces(text, add_special_tokens))

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: special tokens added as the engine adds them (BOS if configured)."""
        return self.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], /, *, add_special_tokens: bool = False, **render_kwargs: Any) -> list[int]:
        """A chat's ids: the rendered prompt tokenized with ``add_special_tokens=False`` (vLLM's default)."""
        return self.encode(self.render_chat(messages, **render_kwargs), add_special_tokens=add_special_tokens)

    async def aencode(self, text: str, *, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """``encode`` that never blocks the event loop on a long text."""
        return _as_list(await self._apieces(text, add_special_tokens, max_tokens))

    async def aencode_bytes(self, text: str, *, add_special_tokens: bool = False, max_tokens: int | None = None) -> bytes:
        """``aencode``'s ids as uint32 little-endian bytes (what block hashing reads), joined in C
        from the cached segments' arrays: no list of ints is built nor converted.  Over
        ``max_tokens``: :class:`PromptTooLong`, found before a huge text is tokenized whole."""
        return to_bytes(await self._apieces(text, add_special_tokens, max_tokens))

    async def aencode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.aencode(text, add_special_tokens=add_special_tokens)

    async def aencode_chat(self, messages: Sequence[Mapping[str, Any]], /, *, add_special_tokens: bool = False, **render_kwargs: Any) -> list[int]:
        return await self.aencode(await self.arender_chat(messages, **render_kwargs), add_special_tokens=add_special_tokens)

    async def run(self, fn: Any) -> Any:
        """``fn()`` on the tokenizer's thread pool (work that follows an encode, e.g. hashing)."""
        return await self._in_pool(fn)

    async def _in_pool(self, fn: Any) -> Any:
        global _pool_jobs
        loop = asyncio.get_running_loop()
        _pool_jobs += 1  # counted on the loop's thread, so no lock
        try:
            return await loop.run_in_executor(self._executor or _default_executor(), fn)
        finally:
            _pool_jobs -= 1

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

