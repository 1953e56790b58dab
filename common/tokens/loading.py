"""Reading a Hugging Face tokenizer directory as transformers reads it.

``tokenizer.json`` with ``tokenizer_config.json``'s rules applied: its special tokens (added when
tokenizer.json lacks them), the post-processor it asks for (add_bos/eos_token), and the chat
template from wherever transformers and vLLM would take it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HfTokenizer
from tokenizers.processors import TemplateProcessing

from kvroute.common.tokens.errors import TokenizerLoadError, TokenizerNotFoundError

# Every file read_dir reads: what is fetched of a Hugging Face model given by id (common/tokens/hub.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template", "chat_template.json")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_dir(path: str | os.PathLike[str], chat_template: str | os.PathLike[str] | None) -> tuple[HfTokenizer, dict, Any]:
    """(backend, config, chat template) of a directory.

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
    return backend, config, template


def special_tokens_of(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The named special tokens of a config (template variables) and its additional ones."""
    special_tokens: dict[str, Any] = {k: _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS if _token_content(config.get(k))}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, Mapping):  # transformers v5 may store named extra tokens
        extra = list(extra.values())
    extra_tokens = [c for c in (_token_content(t) for t in extra) if c]
    if extra_tokens:
        special_tokens["additional_special_tokens"] = extra_tokens
    return special_tokens, extra_tokens


def add_missing_special_tokens(backend: HfTokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, Any], extra_tokens: list[str]) -> None:
    """transformers adds the config's special tokens that tokenizer.json lacks; so do we."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder") or {}
    wanted: list[AddedToken] = []
    for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if isinstance(spec, Mapping) and spec.get("content") and spec["content"] not in present:
            wanted.append(AddedToken(spec["content"], single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                                     rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", False), special=spec.get("special", True)))
    named = [v for k, v in special_tokens.items() if k != "additional_special_tokens"] + extra_tokens
    for content in named:
        if content not in present and all(t.content != content for t in wanted):
            wanted.append(AddedToken(content, special=True, normalized=False))
    if wanted:
        backend.add_tokens(wanted)  # keeps each token's own `special` flag


def install_post_processor(backend: HfTokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, Any]) -> None:
    """transformers rebuilds the post-processor when the config sets add_bos/eos_token explicitly."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    specials = ([(bos, backend.token_to_id(bos))] if add_bos else []) + ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
