"""The gate's tables."""

from __future__ import annotations

import math
from typing import Any

from .settings import COMPARE_PREFIX, DEFAULT_POLICY, SIM_PREFIX, TTFT_KEYS
from .verdict import metric_label


def fmt_ms(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def print_workload(name: str, w: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from ..report import pct

    info = w["workload"]
    slow = f", replica {info['slow_factor']:g}x slower" if info.get("slow_replicas") else ""
    table = Table(title=f"{name}: {info['requests']} requests, {info['load']:.0%} load{slow}, replicas' time scale "
                  f"{info['time_scale']:.2f}, {info['wall_rate']:g} req/s", title_justify="left")
    for col in ("config", "available", "delivered", "deliv/avail", "TTFT p50", "TTFT p90", "TTFT p99",
                "engine p50/p90/p99", "errors", "note"):
        table.add_column(col, justify="left" if col in ("config", "note") else "right")
    limit = w.get("limit") or {}
    if limit:
        table.add_row("[i]physical limit[/]", "", "", "", *(fmt_ms(limit[k]) for k in TTFT_KEYS), "", "", "",
                      end_section=True)

    def mult(x: float | None, k: str) -> str:
        return f"{x / limit[k]:.2f}x" if x is not None and limit.get(k) and math.isfinite(x) else "-"

    live = list(w["configs"].items())
    for i, (cfg, fig) in enumerate([*live, *w.get("sim", {}).items()]):
        sim = cfg.startswith(SIM_PREFIX)
        client = ["" if sim else f"{mult(fig.get(k), k)} {fmt_ms(fig.get(k))}" for k in TTFT_KEYS]
        engine = fig if sim else (fig.get("engine") or {})
        notes = []
        if fig.get("slow_share") is not None:
            notes.append(f"slow replica {fig['slow_share']:.0%} of requests")
        cpu = fig.get("cpu_s") or {}
        if cpu.get("router") is not None:
            notes.append(f"router {cpu['router']:.1f} s")
        if cpu.get("others_cores") is not None:
            notes.append(f"others {cpu['others_cores']:.1f}")
        table.add_row(cfg, pct(fig.get("reuse_available", math.nan)), pct(fig.get("reuse_delivered", math.nan)),
                      pct(fig.get("delivered_share_of_available", math.nan)), *client,
                      " / ".join(mult(engine.get(k), k) for k in TTFT_KEYS), str(fig.get("errors", 0)),
                      ", ".join(notes), end_section=i == len(live) - 1)
    table.caption = ("TTFT: at the client, as a multiple of the physical limit's percentile (each request alone on an idle "
                     "replica, one infinite shared cache), then wall ms; a failed request (errors) counts as the request "
                     "timeout, the time its user waited for nothing.  engine: the replicas' own TTFT (submission to first "
                     "token: no HTTP, router or client time, so little of this machine's noise), as multiples.  sim: the "
                     "simulator on the same requests (engine time x time scale).  note: the slow replica's share of the requests, the "
                     "router's CPU seconds during the replay, the cores other jobs on the machine took meanwhile.")
    table.caption_justify = "left"
    console.print(table)
    v = w.get("verdict")
    if v is not None:
        deltas = ", ".join(f"reuse {d * 100:+.1f} pts" if m == "reuse" else f"errors {d:+.0f}" if m == "errors"
                           else f"{metric_label(m)} {d:+.0%}" for m, d in v["deltas"].items())
        if v["regression"]:
            console.print(f"[bold red]REGRESSION[/] {name}: {DEFAULT_POLICY} vs {COMPARE_PREFIX}{DEFAULT_POLICY}: "
                          f"{'; '.join(v['worse'])}  ({deltas})")
        else:
            console.print(f"[green]OK[/] {name}: {DEFAULT_POLICY} vs {COMPARE_PREFIX}{DEFAULT_POLICY} within the "
                          f"run-to-run spread ({deltas})")
        if v.get("note"):
            console.print(f"   [yellow]{v['note']}[/]")


