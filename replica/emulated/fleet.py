"""A fleet of emulated replicas in one process, for benchmarks that start routers against it.

    python -m kvroute.replica.emulated.fleet --replicas 8 --time-scale 2 [--slow 1 --slow-factor 10]
        [--model NAME] [--profile NAME] [--tokenizer DIR] [--host 127.0.0.1] [--control-port 0]

One asyncio process hosts N `EmulatedReplica` servers, each on free ports of its own (HTTP, KV
events, replay), sharing one tokenizer.  Stdout's first line is one JSON object: ``control`` (the
fleet's control URL) and ``replicas``, each ``{url, events_endpoint, replay_endpoint,
time_scale}``: the first three are what a router's config file takes as a replica object
(router/config.py), so the router follows each replica's KV events without Redis or the port
convention.  ``--slow K --slow-factor F``: the last K replicas run F times slower (their
``time_scale`` F times the others'), healthy otherwise.

Control (HTTP, on ``control``): ``POST /reset`` waits until no replica runs a request, empties
every replica's prefix cache (vLLM's ``/reset_prefix_cache``: an ``AllBlocksCleared`` event) and
the shared tokenizer's segment cache, so that the next run starts as cold as a fresh fleet
without a restart; ``GET /ttfts`` lists the engines' own TTFTs since the last reset (each
request's first token minus its submission to the engine, in virtual seconds times that
replica's time scale: wall seconds of an unloaded machine; what the HTTP servers, the router and
the client add is not in it); ``GET /replicas`` repeats the first line's object.  SIGTERM or
SIGINT stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from aiohttp import web

RESET_TIMEOUT_S = 60.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    from .profile import PROFILES

    p = argparse.ArgumentParser(prog="python -m kvroute.replica.emulated.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8, help="replicas (default 8)")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per engine second (default 1)")
    p.add_argument("--slow", type=int, default=0, help="this many replicas (the last ones) run slower (default 0)")
    p.add_argument("--slow-factor", type=float, default=10.0, help="how much slower: their time scale times this (default 10)")
    p.add_argument("--model", default="gate", help="served model name (default gate)")
    p.add_argument("--profile", default="default", choices=sorted(PROFILES), help="timing profile (default: the H100 one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the tiny tokenizer)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default min(32768, KV capacity))")
    p.add_argument("--host", default="127.0.0.1", help="address of every socket (default 127.0.0.1)")
    p.add_argument("--control-port", type=int, default=0, help="control HTTP port (default: a free one)")
    args = p.parse_args(argv)
    if args.replicas < 1 or not 0 <= args.slow <= args.replicas:
        p.error("--replicas must be at least 1 and --slow between 0 and --replicas")
    if args.time_scale <= 0 or args.slow_factor <= 0:
        p.error("--time-scale and --slow-factor must be positive")
    return args


class Fleet:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.replicas: list[Any] = []
        self.scales: list[float] = []
        self.tokenizer: Any = None
        self.ttfts: list[list[float]] = []  # per replica, engine TTFTs (wall-equivalent s) since the reset

    async def start(self) -> None:
        from kvroute.replica.assets import TINY_TOKENIZER
        from kvroute.common.tokens import Tokenizer

        from .server import EmulatedReplica, ReplicaConfig

        a = self.args
        tokenizer_dir = a.tokenizer or str(TINY_TOKENIZER)
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        for i in range(a.replicas):
            scale = a.time_scale * (a.slow_factor if i >= a.replicas - a.slow else 1.0)
            config = ReplicaConfig(model=a.model, host=a.host, port=0, tokenizer_dir=tokenizer_dir, profile=a.profile,
                                   time_scale=scale, max_model_len=a.max_model_len,
                                   events_endpoint=f"tcp://{a.host}:*", replay_endpoint=f"tcp://{a.host}:*")
            replica = EmulatedReplica(config, tokenizer=self.tokenizer)
            self.ttfts.append([])
            record = replica.metrics.first_token  # the driver reports each first token here

            def first_token(ttft_s: float, _record: Any = record, _into: list[float] = self.ttfts[-1], _scale: float = scale) -> None:
                _into.append(ttft_s * _scale)
                _record(ttft_s)

            replica.metrics.first_token = first_token  # type: ignore[method-assign]
            await replica.start()
            self.replicas.append(replica)
            self.scales.append(scale)

    async def stop(self) -> None:
        replicas, self.replicas = self.replicas, []
        for replica in reversed(replicas):
            await replica.stop()

    def describe(self, control: str) -> dict[str, Any]:
        return {
            "control": control,
            "model": self.args.model,
            "profile": self.args.profile,
            "replicas": [
                {"url": r.url, "events_endpoint": r.events_endpoint, "replay_endpoint": r.replay_endpoint, "time_scale": s}
                for r, s in zip(self.replicas, self.scales)
            ],
        }

    async def reset(self, timeout_s: float) -> dict[str, Any]:
        """Every replica's prefix cache emptied (once it runs nothing), then the tokenizer's cache."""
        t0 = time.monotonic()
        pending = list(self.replicas)
        while pending:
            pending = [r for r in pending if not r.driver.reset_prefix_cache()]
            if pending:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{len(pending)} replicas still run requests after {timeout_s:g} s")
                await asyncio.sleep(0.05)
        self.tokenizer.cache.clear()
        for ttfts in self.ttfts:
            ttfts.clear()
        return {"reset": len(self.replicas), "waited_s": round(time.monotonic() - t0, 3)}


async def serve(args: argparse.Namespace) -> int:
    fleet = Fleet(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def reset(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        try:
            return web.json_response(await fleet.reset(float(body.get("timeout_s", RESET_TIMEOUT_S))))
        except TimeoutError as exc:
            return web.json_response({"error": str(exc)}, status=409)

    app = web.Application()
    app.router.add_post("/reset", reset)
    app.router.add_get("/replicas", lambda _: web.json_response(fleet.describe(control)))
    app.router.add_get("/ttfts", lambda _: web.json_response({"ttfts": fleet.ttfts}))
    runner = web.AppRunner(app, access_log=None)
    try:
        await fleet.start()
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.control_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound port (0 asked for any)
        control = f"http://{args.host}:{port}"
        print(json.dumps(fleet.describe(control)), flush=True)  # first line: the caller reads it
        await stop.wait()
    finally:
        await runner.cleanup()
        await fleet.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # As `kvroute demo`: no rayon pool for the tokenizer (its batch encoder would stall the loop).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import uvloop

    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
