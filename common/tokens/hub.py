"""A tokenizer named by its Hugging Face model id (``org/name``, or ``org/name@revision``).

Resolved by ``huggingface_hub`` to a local snapshot holding only the tokenizer's files, so its
conventions hold: the cache under ``HF_HOME``/``HF_HUB_CACHE``, ``HF_TOKEN`` for gated models,
``HF_HUB_OFFLINE=1`` to read the cache without any network.  A directory that exists is always
taken as a directory, even when its name could be an id.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvroute.common.tokens.errors import TokenizerNotFoundError
from kvroute.common.tokens.loading import TOKENIZER_FILES


def hub_model_id(spec: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``spec`` names a Hub model rather than an existing directory."""
    if Path(spec).expanduser().is_dir():
        return None
    repo_id, _, revision = str(spec).partition("@")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)  # paths fail it: ./x, /x, ~/x, a/b/c
    except HFValidationError:
        return None
    return repo_id, revision or None


def tokenizer_dir(spec: str | os.PathLike[str]) -> Path:
    """The directory to load: ``spec`` itself, or the Hub model's snapshot (fetched if need be).

    Raises :class:`TokenizerNotFoundError` saying why when the model cannot be had (offline and
    not cached, unknown, gated without a token, no network)."""
    hub = hub_model_id(spec)
    if hub is None:
        return Path(spec).expanduser()
    repo_id, revision = hub
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import EntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(TOKENIZER_FILES)))
    except (OSError, ValueError, EntryNotFoundError) as exc:
        where = (f"HF_HUB_OFFLINE is set and it is not in the cache ({constants.HF_HUB_CACHE})"
                 if constants.HF_HUB_OFFLINE else "the Hugging Face Hub did not give it")
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerNotFoundError(
            f"tokenizer {str(spec)!r}: not a directory, nor a Hugging Face model to be had: {where} ({reason})"
        ) from exc
    if not (snapshot / "tokenizer.json").is_file():
        raise TokenizerNotFoundError(f"tokenizer {str(spec)!r}: the Hugging Face model {repo_id!r} has no tokenizer.json")
    return snapshot
