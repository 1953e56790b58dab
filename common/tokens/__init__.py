"""Prompt tokenization for the router: a model's own tokenizer.json and chat template.

    segments.py         where tokenizers cuts a prompt (added tokens), and the cache of pieces' ids
    chat_template.py    the sandboxed Jinja environment, message/tool normalization, render()
    client_templates.py clients' own templates, rendered in worker processes under budgets
    template_worker.py  that worker process
    tokenizer.py        Tokenizer: one model's tokenizer + template, one encode path
    long_text.py        verified cuts: very long texts in chunks
    loading.py          a Hugging Face tokenizer directory, read as transformers reads it
    registry.py         which tokenizer each model uses
    memory.py           giving freed heap back to the OS after a huge prompt
    errors.py           the errors
"""

from kvroute.common.tokens.chat_template import ContentFormat, RenderJob, detect_content_format, normalize_messages, normalize_tools, render
from kvroute.common.tokens.client_templates import ClientTemplates
from kvroute.common.tokens.errors import (
    ChatTemplateError,
    ClientTemplateRefused,
    PromptTooLong,
    TokenizerError,
    TokenizerLoadError,
    TokenizerNotFoundError,
    UnsupportedContentError,
)
from kvroute.common.tokens.registry import TokenizerRegistry
from kvroute.common.tokens.segments import CacheStats, SegmentCache
from kvroute.common.tokens.tokenizer import Tokenizer

__all__ = [
    "CacheStats",
    "ChatTemplateError",
    "ClientTemplateRefused",
    "ClientTemplates",
    "ContentFormat",
    "PromptTooLong",
    "RenderJob",
    "SegmentCache",
    "Tokenizer",
    "TokenizerError",
    "TokenizerLoadError",
    "TokenizerNotFoundError",
    "TokenizerRegistry",
    "UnsupportedContentError",
    "detect_content_format",
    "normalize_messages",
    "normalize_tools",
    "render",
]
