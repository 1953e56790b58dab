"""`kvroute replica`: run one replica.

    kvroute replica --engine emulated --port P [--host H] --model NAME [--tokenizer DIR]
                    [--profile NAME] [--block-size N] [--num-gpu-blocks N] [--max-model-len N]
                    [--events-endpoint tcp://*:P] [--replay-endpoint tcp://*:P] [--events-topic T]
                    [--api-key KEY] [--time-scale X]

``--engine vllm`` (launching a real vLLM with the right flags) is not implemented yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    from replica.emulated.profile import PROFILES

    p = argparse.ArgumentParser(prog="kvroute replica", description="Run a replica speaking vLLM's OpenAI protocol.")
    p.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                   help="emulated: modelled prefix cache and timing; vllm: launch a real vLLM (not implemented yet)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port, printed at start)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="directory with tokenizer.json (+ tokenizer_config.json); default: the project's tiny tokenizer")
    p.add_argument("--profile", default="default", choices=sorted(PROFILES), help="timing profile of the emulated engine")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the profile's)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV capacity in blocks (default: the profile's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: min(32768, KV capacity))")
    p.add_argument("--events-endpoint", default=None,
                   help="ZMQ PUB for KV events: tcp://*:P binds, tcp://HOST:P connects (default: no events)")
    p.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER serving replay of buffered event batches")
    p.add_argument("--events-topic", default="kv", help="topic frame of every event message")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per emulated second: 0.1 runs 10x faster, 0 answers at once")
    p.add_argument("--default-max-tokens", type=int, default=16,
                   help="output length of chat requests that set no max_tokens (they finish with 'stop')")
    p.add_argument("--log-level", default="INFO")
    return p


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("block_size", "num_gpu_blocks", "max_model_len", "default_max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.time_scale < 0:
        parser.error("--time-scale must be >= 0")
    if not 0 <= args.port < 65536:
        parser.error("--port must be in 0..65535")
    if args.replay_endpoint and not args.events_endpoint:
        parser.error("--replay-endpoint needs --events-endpoint")


async def _run(config: object) -> None:
    from replica.emulated.server import EmulatedReplica

    replica = EmulatedReplica(config)  # type: ignore[arg-type]
    await replica.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    events = f" events {replica.events_endpoint}" if replica.events_endpoint else ""
    replay = f" replay {replica.replay_endpoint}" if replica.replay_endpoint else ""
    print(f"{replica.url} model={replica.model} block_size={replica.block_size} "
          f"num_gpu_blocks={replica.num_gpu_blocks}{events}{replay}", flush=True)
    try:
        await stop.wait()
    finally:
        await replica.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        print("kvroute replica: --engine vllm is not implemented yet (use --engine emulated)", file=sys.stderr)
        return 2
    _check(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from replica.emulated.server import ReplicaConfig

    config = ReplicaConfig(
        model=args.model, host=args.host, port=args.port, tokenizer_dir=args.tokenizer, profile=args.profile,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
        events_endpoint=args.events_endpoint, replay_endpoint=args.replay_endpoint, events_topic=args.events_topic,
        api_key=args.api_key, time_scale=args.time_scale, default_max_tokens=args.default_max_tokens,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency, but the replica runs without it
        runner = asyncio.run
    try:
        runner(_run(config))
    except (ValueError, OSError) as exc:  # bad profile/lengths, port or endpoint in use
        print(f"kvroute replica: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
