"""What ``--tracing`` costs the router: ``python -m kvroute.bench.tracing_cost``.

As ``access_log_cost`` (emulated replicas answering at once, the same short chats streamed and
not, interleaved rounds, each router's CPU time per request from ``/proc``), between routers that
differ only in tracing: off (the client's context passed on), on with every request sampled and its
spans exported to nowhere (``OTEL_TRACES_EXPORTER=none``: made and ended, the exporter's cost
left out, as it depends on the collector), and on with nothing sampled
(``OTEL_TRACES_SAMPLER=always_off``).  Access logs off in all three.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from kvroute.bench.access_log_cost import compare_routers, parse_args

VARIANTS = {
    "off": ([], {}),
    "sampled": (["--tracing"], {"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_on"}),
    "unsampled": (["--tracing"], {"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_off"}),
}


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await compare_routers(args, VARIANTS, Path(tmp))


def main() -> None:
    asyncio.run(run(parse_args("kvroute.bench.tracing_cost", __doc__)))


if __name__ == "__main__":
    main()
