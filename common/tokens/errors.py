"""The errors of kvroute.common.tokens."""

from __future__ import annotations


class TokenizerError(Exception):
    """Base class of the errors of this package."""


class TokenizerLoadError(TokenizerError):
    """A tokenizer file exists but cannot be read or parsed."""


class TokenizerNotFoundError(TokenizerLoadError, FileNotFoundError):
    """The tokenizer directory or its tokenizer.json is missing."""


class ChatTemplateError(TokenizerError, ValueError):
    """The chat cannot be rendered: no template, invalid messages, or the template refused them."""


class UnsupportedContentError(ChatTemplateError):
    """A message holds non-text content (image, audio, ...): its tokens depend on the engine."""


class ClientTemplateRefused(Exception):
    """A request's own chat template was not rendered: disabled, or over its time or size budget.

    Not a :class:`TokenizerError` on purpose: a caller that falls back to approximate tokens on
    those must answer this one with a 400 instead (``code`` says which rule refused it).
    """

    def __init__(self, message: str, code: str, *, status: int = 400):
        super().__init__(message)
        self.code = code
        self.status = status


class PromptTooLong(Exception):
    """A prompt has more tokens than the caller's limit (found without tokenizing all of it).

    Not a :class:`TokenizerError`: it is the client's to fix, never a reason to fall back.
    """

    def __init__(self, tokens: int, limit: int, *, at_least: bool):
        what = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(f"prompt is {what} tokens long, more than the limit of {limit}")
        self.tokens = tokens
        self.limit = limit
