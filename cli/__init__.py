"""`kvroute` console script: one subcommand per component, each owned by its own module."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, help); modules are imported lazily so `kvroute sim` does not
# pay for aiohttp and `kvroute router` does not pay for matplotlib.
COMMANDS = {
    "sim": ("kvroute.bench.sim_cli", "main", "fleet simulator: compare routing policies in virtual time"),
    "router": ("kvroute.router.main", "main", "run the cache-aware router (OpenAI-compatible proxy)"),
    "replica": ("kvroute.replica.cli", "main", "run a replica: emulated, or real vLLM through the launcher"),
    "demo": ("kvroute.bench.demo", "main", "router + emulated (or --engine vllm) replicas on loopback, round_robin vs cost_model"),
    "bench": ("kvroute.bench.cli", "main", "benchmarks against a live endpoint: `kvroute bench replay --trace FILE --url URL`"),
}


def usage() -> str:
    lines = ["usage: kvroute [--version] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`kvroute COMMAND --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from kvroute.router.settings_cli import version

        print(f"kvroute {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"kvroute: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[cmd]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
