"""`kvroute bench SUBCOMMAND`: benchmarks an operator runs against a live endpoint."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help); each module has main(argv) and is imported only when chosen.
SUBCOMMANDS = {
    "replay": ("kvroute.bench.replay", "replay a Mooncake-format trace or a chat trace against an OpenAI-compatible endpoint"),
    "gate": ("kvroute.bench.routing_gate", "the live routing gate: routers in front of emulated replicas, every workload (make bench-routing)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        lines = ["usage: kvroute bench SUBCOMMAND [options]", "", "subcommands:"]
        lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("\n".join(lines), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, _ = SUBCOMMANDS[argv[0]]
    return int(importlib.import_module(module).main(argv[1:]) or 0)
