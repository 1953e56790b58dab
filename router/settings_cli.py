"""The command line of a pydantic-settings model, with a `--help` people can read.

pydantic-settings names each flag's value after its Python type (``{str,None}``, ``dict[str,str]``,
``list[SecretStr]``) and prints ``(default factory: list)``.  Here a value is named after what it
is: a field's ``json_schema_extra={"metavar": ...}`` when it has one, else a rule on its type and
name (``N``, ``SECONDS``, ``URL``, ``KEY=VALUE``); literal choices keep pydantic's ``{a,b,c}``.
Defaults read as words (``unset``, ``none``, ``empty``, ``on``/``off``).  Parsing is pydantic-settings' own.
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliSettingsSource

_SCALARS = {int: "N", float: "X", str: "TEXT", Path: "FILE", SecretStr: "SECRET"}
# A scalar's unit from its name: `*_timeout_s` is SECONDS rather than X.
_SUFFIXES = (("_s", "SECONDS"), ("_url", "URL"), ("_bytes", "BYTES"), ("_blocks", "BLOCKS"), ("_tokens", "TOKENS"))
_DEFAULT_WORDS = {
    "(default factory: list)": "(default: none)",
    "(default factory: dict)": "(default: none)",
    "(default: [])": "(default: none)",
    "(default: {})": "(default: none)",
    "(default: )": "(default: empty)",  # an empty string, which argparse prints as nothing
    "(default: None)": "(default: unset)",
    "(default: True)": "(default: on)",
    "(default: False)": "(default: off)",
}
_DEFAULT_RE = re.compile("|".join(re.escape(k) for k in _DEFAULT_WORDS))


def version() -> str:
    """The installed distribution's version (the wheel's metadata), or say it is not installed."""
    try:
        return metadata.version("kvroute")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"


def hint(metavar: str) -> dict[str, Any]:
    """A field's ``json_schema_extra`` naming its value in --help: ``Field(..., json_schema_extra=hint("URL"))``."""
    return {"metavar": metavar}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def metavar(name: str, field: FieldInfo) -> str | None:
    """What a flag's value is called in --help; None keeps pydantic-settings' own (choices, flags)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "metavar" in extra:
        return str(extra["metavar"])
    annotation = _without_none(field.annotation)
    origin = get_origin(annotation)
    if origin is Literal or annotation is bool:
        return None
    if origin is list:
        return "ITEM[,ITEM...]"
    if origin is dict:
        return "KEY=VALUE"
    base = _SCALARS.get(annotation)
    if base is None:
        return "JSON"
    unit = next((word for suffix, word in _SUFFIXES if name.endswith(suffix)), None)
    return unit if unit and base in ("N", "X", "TEXT") else base


def flag_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(argparse dest, field) of every flag: nested models' fields as ``parent.child``."""
    for name, field in model.model_fields.items():
        annotation = _without_none(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from flag_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _readable_add_argument(metavars: dict[str, str | None]) -> Callable[..., Any]:
    def add_argument(container: Any, *names: str, **kwargs: Any) -> Any:
        dest = kwargs.get("dest")
        if "metavar" in kwargs and metavars.get(dest):
            kwargs["metavar"] = metavars[dest]
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = _DEFAULT_RE.sub(lambda m: _DEFAULT_WORDS[m.group(0)], kwargs["help"])
        return container.add_argument(*names, **kwargs)

    return add_argument


def cli_source(
    settings_cls: type[BaseSettings], prog: str, args: Sequence[str], description: str | None = None
) -> CliSettingsSource[Any]:
    """The settings' command line (the model_config's ``cli_*`` options), parsed from ``args``;
    ``--version`` prints the installed version."""
    config = settings_cls.model_config
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{prog} {version()}",
                        help="print the installed version and exit")
    metavars = {dest: metavar(dest.rsplit(".", 1)[-1], field) for dest, field in flag_fields(settings_cls)}
    source = CliSettingsSource(
        settings_cls,
        cli_prog_name=prog,
        cli_kebab_case=config.get("cli_kebab_case"),
        cli_implicit_flags=config.get("cli_implicit_flags"),
        cli_avoid_json=config.get("cli_avoid_json"),
        root_parser=parser,
        add_argument_method=_readable_add_argument(metavars),
    )
    return source(args=list(args))
