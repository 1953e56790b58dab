"""A span that records nothing: tracing off (router/tracing.py), or a request its trace does not
sample (router/otel.py).  Its own module so that both use it without importing each other."""

from __future__ import annotations

from typing import Any


class Span:
    """What the handlers call on a span: ``set`` attributes, ``end`` with the HTTP status."""

    __slots__ = ()

    def set(self, **attributes: Any) -> None:
        pass

    def end(self, status: int | None = None) -> None:
        pass


NO_SPAN = Span()
