"""Which tokenizer each model uses."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.common.tokens.client_templates import ClientTemplates
from kvroute.common.tokens.hub import hub_model_id, tokenizer_dir
from kvroute.common.tokens.tokenizer import Tokenizer


class TokenizerRegistry:
    """Which tokenizer each model uses: explicit per-model directories, else an optional default.

    Models that share a directory share one :class:`Tokenizer` (and its cache), e.g. LoRA adapters
    served under their own names on one base model.
    """

    def __init__(
        self,
        by_model: Mapping[str, Tokenizer] | None = None,
        default: Tokenizer | None = None,
        *,
        client_templates: ClientTemplates | None = None,
    ):
        self._by_model = dict(by_model or {})
        self.default = default
        # where clients' own chat templates render; None: they are not rendered (refused)
        self.client_templates = client_templates

    @classmethod
    def from_config(
        cls,
        dirs: Mapping[str, str | os.PathLike[str]] | None = None,
        default_dir: str | os.PathLike[str] | None = None,
        *,
        client_templates: ClientTemplates | None = None,
        **tokenizer_kwargs: Any,
    ) -> TokenizerRegistry:
        """Load every configured tokenizer now (a directory, or a Hugging Face model id fetched
        through its cache), so a bad path or id fails at startup, not on a request."""
        loaded: dict[Path, Tokenizer] = {}

        def load(spec: str | os.PathLike[str]) -> Tokenizer:
            key = tokenizer_dir(spec).resolve()  # a Hub id and its snapshot's path share one Tokenizer
            if key not in loaded:
                name = str(spec) if hub_model_id(spec) else key.name
                loaded[key] = Tokenizer.from_dir(key, name=name, **tokenizer_kwargs)
            return loaded[key]

        by_model = {model: load(path) for model, path in (dirs or {}).items()}
        default = load(default_dir) if default_dir is not None else None
        return cls(by_model, default, client_templates=client_templates)

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

    async def aclose(self) -> None:
        """Stop the client-template workers, if any."""
        if self.client_templates is not None:
            await self.client_templates.aclose()
