"""Presenting simulator results: a rich table, one JSON object, or a PNG of TTFT CDFs and reuse."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from kvroute.bench.limit import LIMIT_KEYS

LIMIT_NOTE = (
    "physical limit: each request alone on an idle replica with one infinite cache shared by the fleet "
    "(only its never-seen blocks prefill); (Nx) = the policy's TTFT percentile over the limit's"
)
REUSE_KEYS = ("reuse_available", "reuse_predicted", "reuse_delivered")
PLOT_EXTRA = "pip install 'kvroute[plot]'"


def pyplot(what: str) -> Any:
    """matplotlib's pyplot on its file-only backend.  matplotlib is the optional `plot` extra:
    without it, ``what`` (e.g. "kvroute sim --plot") exits saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{what} needs matplotlib, an optional dependency: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def to_json(policies: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any] | None = None) -> str:
    """`{"policies": {NAME: {...}}, ...extra}` on one line (NaN becomes null: JSON has no NaN)."""

    doc: dict[str, Any] = {"policies": {name: json_safe(dict(m)) for name, m in policies.items()}}
    for k, v in (extra or {}).items():
        doc.setdefault(k, json_safe(v))
    return json.dumps(doc)


def json_safe(v: Any) -> Any:
    """NaN and infinities become null, in nested dicts too (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    return v


def pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def secs(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if x < 0.01:
        return f"{x * 1000:.1f} ms"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def secs_vs(x: float, limit: float | None) -> str:
    """Seconds, and the multiple of the limit when there is one."""
    if limit is None or not math.isfinite(x) or not limit or not math.isfinite(limit):
        return secs(x)
    return f"{secs(x)} ({x / limit:.1f}x)"


def print_table(
    policies: Mapping[str, Mapping[str, Any]],
    title: str,
    file: IO[str] | None = None,
    footer: str = "",
    limit: Mapping[str, float] | None = None,
) -> None:
    """One row per policy; with `limit` (bench/limit.py), a first row for the physical limit and
    each TTFT percentile followed by its multiple of the limit's."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=footer or None, caption_justify="left")
    for col in ("policy", "requests", "available", "predicted", "delivered", "deliv/avail", "TTFT p50", "TTFT p90", "TTFT p99", "imbalance", "req/s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    if limit is not None:
        table.add_row("[i]physical limit[/]", "", "", "", "", "", *(secs(limit[k]) for k in LIMIT_KEYS), "", "", end_section=True)
    for name, m in policies.items():
        avail = m["reuse_available"]
        ratio = m["reuse_delivered"] / avail if avail else math.nan
        table.add_row(
            name,
            str(m["requests"]),
            pct(avail),
            pct(m["reuse_predicted"]),
            pct(m["reuse_delivered"]),
            pct(ratio),
            *(secs_vs(m[k], None if limit is None else limit[k]) for k in LIMIT_KEYS),
            f"{m['imbalance']:.2f}",
            f"{m['throughput_rps']:.2f}",
        )
    Console(file=file, width=160).print(table)


def plot(ttfts: Mapping[str, np.ndarray], policies: Mapping[str, Mapping[str, Any]], path: str, title: str = "") -> None:
    """TTFT CDF per policy (log time axis) and the three reuse figures per policy."""
    plt = pyplot("kvroute sim --plot")

    fig, (ax_cdf, ax_reuse) = plt.subplots(1, 2, figsize=(14, 5.5))
    for name, ttft in ttfts.items():
        if ttft.size == 0:
            continue
        xs = np.sort(ttft)
        ax_cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)

    names = list(policies)
    x = np.arange(len(names))
    width = 0.27
    for k, key in enumerate(REUSE_KEYS):
        ax_reuse.bar(x + (k - 1) * width, [policies[n][key] for n in names], width, label=key.removeprefix("reuse_"))
    ax_reuse.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
    ax_reuse.set_ylim(0, 1.15)  # room for the legend above full bars
    ax_reuse.set_ylabel("fraction of prompt tokens (full blocks)")
    ax_reuse.set_title("prefix reuse: available / predicted / delivered")
    ax_reuse.legend(fontsize=8, ncol=3, loc="upper center")
    if title:
        fig.suptitle("\n".join(textwrap.fill(line, 130) for line in title.splitlines()), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
