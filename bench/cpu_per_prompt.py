"""The router's CPU per new prompt against its floor, the tokenizer's own encode:
``python -m kvroute.bench.cpu_per_prompt``.

A new long prompt costs the router its tokenization before anything else (docs/design.md §1), so
the yardstick of what the router adds is the tokenizer alone (issue 20, item 8: target at most
1.3x the encode plus 0.3 ms).  One run, all figures side by side:

* **the router**: ``kvroute router`` (one process, cost_model, the tiny tokenizer shipped in
  ``replica/assets/tiny-tokenizer``, in-memory index, the access log written) in front of
  emulated replicas with ``time_scale`` 0 (in one child process of their own); this process sends
  chats in a closed loop (``--concurrency`` at a time, each body built beforehand), each a new
  ~16 KB user message (``bench/chat_text.py``: prose, code, tables, JSON, CJK; ``--text words``:
  the plain word list of ``bench/router_overhead.py``) that no earlier request shares a segment
  with.  Its CPU per request: the router process's user + system time (``/proc/PID/stat``, every
  thread) over the requests.  A one-line chat is measured the same way, the HTTP floor.
* **the encode alone**: in this process, while nothing else runs in it, the CPU time of this
  thread (``CLOCK_THREAD_CPUTIME_ID``) around ``tokenizers``' ``encode_batch_fast`` of each
  prompt rendered with the model's chat template (``add_special_tokens=False``, vLLM's chat
  setting), on fresh prompts of the same kind (a prompt encoded once is no floor: ``tokenizers``
  caches words); and the same encode sampled beside each router's load, by a process of its own
  that encodes a prompt every 30 ms: on this shared 2-core machine an encode costs 20-35% more CPU
  while the router, the replicas and the client keep the other core busy, and so does the
  router's own, so the ratio that compares like with like is the one against this figure.
* **the stages in-process**: the router's own steps, each timed by its thread's CPU on fresh
  prompts of the same kind: the body parsed, the template rendered, the router's encode path
  (split at special tokens, the encode, ids kept as arrays and cached), the block chain, index
  lookup + policy + record, the upstream body, the reuse accounting.  What the live figure has
  beyond them (HTTP in and out, the thread-pool hop, metrics, the access log) is what a one-line
  chat costs plus what 16 KB more bytes add to it.

``--compare CHECKOUT`` runs another checkout's router (a change's before) beside this one's, in
the same rounds, the order reversed every other round: the ratio that counts is the one measured
side by side in one run, on a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvroute.bench.chat_text import chat_text
from kvroute.bench.processes import checkout_command, stop_all
from kvroute.bench.router_overhead import _REPLICAS_CHILD, CLK_TCK, spawn, text_of
from kvroute.common.tokens import Tokenizer
from kvroute.replica.assets import TINY_TOKENIZER

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench"
TARGET_RATIO, TARGET_PLUS_MS = 1.3, 0.3  # issue 20, item 8
ENCODER_PAUSE_S = 0.03  # between the encodes sampled beside the load: ~15% of a core


class Prompts:
    """Request bodies, each a chat never sent before: ``new(n)`` long ones, ``short(n)`` one-liners."""

    def __init__(self, size: int, text: str, seed: int):
        self.size = size
        self.text = text
        self.seed = seed
        self.count = 0
        self._rng = np.random.default_rng(seed)

    def content(self) -> str:
        self.count += 1
        if self.text == "words":
            return text_of(self._rng, self.size)
        # a paste after a line of its own: no two prompts share a segment, hence no cached piece
        return f"Request {self.count} of run {self.seed}, please read:\n" + chat_text((self.seed, self.count), self.size)

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.content()}]

    @staticmethod
    def body(messages: list[dict[str, str]]) -> bytes:
        return json.dumps({"model": MODEL, "max_tokens": 1, "messages": messages}).encode()

    def new(self, n: int) -> list[bytes]:
        return [self.body(self.messages()) for _ in range(n)]

    def short(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            self.count += 1
            out.append(self.body([{"role": "user", "content": f"Hello number {self.count}."}]))
        return out


def proc_stat(pid: int) -> tuple[float, float, int, float]:
    """User and system CPU seconds of ``pid`` (every thread), its minor page faults, and the CPU
    seconds of its main thread alone (the event loop; the rest is the tokenizer pool's, mostly)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        main = f.read().rsplit(")", 1)[1].split()
    loop = (int(main[11]) + int(main[12])) / CLK_TCK
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK, int(fields[7]), loop


async def closed_loop(session: aiohttp.ClientSession, url: str, bodies: list[bytes], concurrency: int) -> None:
    """Every body sent once, ``concurrency`` at a time; each answer must be a 200."""
    pending = iter(bodies)
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        for body in pending:
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status} {data[:300]!r}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def encode_alone(tok: Tokenizer, prompts: Prompts, n: int) -> float:
    """CPU seconds of this thread per encode of ``n`` fresh rendered prompts, the tokenizer alone."""
    texts = [tok.render_chat(prompts.messages()) for _ in range(n)]
    encode = tok.backend.encode_batch_fast
    spent = 0.0
    for text in texts:
        t0 = time.thread_time()
        encode([text], add_special_tokens=False)
        spent += time.thread_time() - t0
    return spent / n


def encoder_child(text: str, size: int, seed: int, pause_s: float) -> None:
    """The encode alone beside the router's load, in a process of its own: while told to (a line
    "go" on stdin, until "stop"), it encodes one fresh rendered prompt, then sleeps ``pause_s``
    (a light load: the figure it samples is what the machine's load does to an encode); on
    "stop" it prints the mean CPU per encode of its thread, in seconds, and how many."""
    import threading

    tok = Tokenizer.from_dir(TINY_TOKENIZER)
    prompts = Prompts(size, text, seed)
    encode = tok.backend.encode_batch_fast
    running = threading.Event()
    print("ready", flush=True)

    def work() -> None:
        while True:
            running.wait()
            spent, n = 0.0, 0
            while running.is_set():
                rendered = tok.render_chat(prompts.messages())
                t0 = time.thread_time()
                encode([rendered], add_special_tokens=False)
                spent += time.thread_time() - t0
                n += 1
                time.sleep(pause_s)
            print(f"{spent / max(1, n)} {n}", flush=True)

    threading.Thread(target=work, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "go":
            running.set()
        elif line.strip() == "stop":
            running.clear()


class Encoder:
    """The encoder child process (:func:`encoder_child`): ``go`` before a load, ``stop`` after it."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.spent = 0.0
        self.count = 0

    async def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"stop\n")
        await self.proc.stdin.drain()
        mean, n = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).split()
        self.spent += float(mean) * int(n)
        self.count += int(n)


async def stages(tok_dir: Path, prompts: Prompts, n: int) -> dict[str, float]:
    """Milliseconds of CPU per step of the router's path in this process (fresh prompts), and the
    tokenizer's own encode of the same rendered text beside them."""
    from kvroute.common.blocks import namespace_seed
    from kvroute.common.requests import parse_request
    from kvroute.router.index.base import ReplicaSpec
    from kvroute.router.index.memory import MemoryIndex
    from kvroute.router.placement.load import LoadTracker
    from kvroute.router.placement.policy import Query, make_policy
    from kvroute.router.placement.sequence import snapshot
    from kvroute.router.request.chain_memo import ChainMemo
    from kvroute.router.request.reuse import ReuseTracker

    tok = Tokenizer.from_dir(tok_dir)
    index, memo, reuse, load, policy = MemoryIndex(), ChainMemo(), ReuseTracker(), LoadTracker(), make_policy("cost_model")
    names = [f"r{i}" for i in range(4)]
    for name in names:
        await index.add_replica(ReplicaSpec(name, 200_000))
    seed = namespace_seed(MODEL)
    spent: dict[str, float] = {}
    clock = time.thread_time

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = clock()
        out = fn()
        spent[key] = spent.get(key, 0.0) + clock() - t0
        return out

    for i in range(-5, n):  # five rounds of warm-up
        if i == 0:
            spent.clear()
        raw = prompts.new(1)[0]
        parsed = timed("parse body", lambda: parse_request("chat", raw))
        text = timed("render template", lambda: tok.render_chat(parsed.body["messages"]))
        timed("encode alone (reference)", lambda: tok.backend.encode_batch_fast([text], add_special_tokens=False))
        data = timed("router's encode path", lambda: b"".join(tok._pieces(text, False)))  # noqa: SLF001
        chain = timed("block chain", lambda: memo.chain(data, 16, seed))

        async def place() -> None:
            query = Query(chain=chain, prompt_tokens=len(data) // 4, block_size=16, matches=await index.lookup(chain))
            choice = policy.choose(query, [snapshot(name, load, 0) for name in names])
            await index.record_prediction(choice.replica, chain)

        t0 = clock()
        await place()
        spent["lookup + policy + record"] = spent.get("lookup + policy + record", 0.0) + clock() - t0
        timed("upstream body", lambda: parsed.forward_body({}))
        timed("reuse accounting", lambda: reuse.observe(MODEL, chain, np.frombuffer(data, dtype="<u4"), 16, seed))
    return {key: value / n * 1e3 for key, value in spent.items()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    procs: list[asyncio.subprocess.Process] = []
    links = tempfile.TemporaryDirectory(prefix="kvroute-compare-")
    logs = tempfile.TemporaryDirectory(prefix="kvroute-cpu-logs-")
    try:
        rep_proc, urls_line = await spawn([py, "-c", _REPLICAS_CHILD, str(args.replicas), MODEL])
        procs.append(rep_proc)
        urls = urls_line.split()
        enc_proc = await asyncio.create_subprocess_exec(
            py, "-m", "kvroute.bench.cpu_per_prompt", "--encoder-child", "--text", args.text,
            "--prompt-chars", str(args.prompt_chars), "--seed", str(args.seed + 13),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        procs.append(enc_proc)
        assert enc_proc.stdout is not None
        await asyncio.wait_for(enc_proc.stdout.readline(), 60)
        routers: dict[str, tuple[str, int]] = {}
        for name, repo in [("kvroute", REPO), *((f"kvroute@{Path(c).name}", Path(c).resolve()) for c in args.compare)]:
            kvroute, env = ([py, "-m", "kvroute.cli"], None) if repo == REPO else \
                checkout_command(repo, Path(links.name) / name)
            log_path = Path(logs.name) / f"{name}.log"
            with open(log_path, "w") as log_file:  # the access log goes somewhere real, as deployed
                proc = await asyncio.create_subprocess_exec(
                    *kvroute, "router", "--host", "127.0.0.1", "--port", "0", "--replicas", ",".join(urls),
                    "--tokenizer", str(TINY_TOKENIZER), "--policy", "cost_model", "--log-level", "info",
                    "--max-in-flight", "4096", "--fleet.health-timeout-s", "10", *args.router_arg,
                    stdout=asyncio.subprocess.PIPE, stderr=log_file, cwd=str(repo), env=env,
                )
            procs.append(proc)
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
            if not line:
                raise RuntimeError(f"router {name} did not start: {log_path.read_text()[-2000:]}")
            routers[name] = (line[-1], proc.pid)
        return await measure(args, routers, Encoder(enc_proc))
    finally:
        await stop_all(procs)
        links.cleanup()
        logs.cleanup()


async def measure(args: argparse.Namespace, routers: dict[str, tuple[str, int]], encoder: Encoder) -> dict[str, Any]:
    prompts = Prompts(args.prompt_chars, args.text, args.seed)
    tok = Tokenizer.from_dir(TINY_TOKENIZER)
    cases = {"new": prompts.new, "short": prompts.short}
    counts = {"new": args.requests, "short": args.requests * 2}
    # [user s, system s, minor faults, event loop s, requests] per router and case
    spent = {name: {case: [0.0, 0.0, 0, 0.0, 0] for case in cases} for name in routers}
    encode_s, encode_n = 0.0, 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        for url, _ in routers.values():  # warm: templates, pools, connections, the tokenizer's words
            await closed_loop(session, url, prompts.new(20) + prompts.short(20), args.concurrency)
        encode_alone(tok, prompts, 20)
        order = list(routers)
        for n_round in range(args.rounds):
            for name in order if n_round % 2 == 0 else order[::-1]:
                url, pid = routers[name]
                for case, make in cases.items():
                    bodies = make(counts[case])
                    if case == "new":
                        await encoder.go()
                    before = proc_stat(pid)
                    await closed_loop(session, url, bodies, args.concurrency)
                    after = proc_stat(pid)
                    if case == "new":
                        await encoder.stop()
                    acc = spent[name][case]
                    for k, (a, b) in enumerate(zip(before, after)):
                        acc[k] += b - a
                    acc[4] += len(bodies)
            encode_s += encode_alone(tok, prompts, args.requests) * args.requests
            encode_n += args.requests
    encode_ms = encode_s / encode_n * 1e3
    beside_ms = encoder.spent / max(1, encoder.count) * 1e3
    sample = tok.render_chat(prompts.messages())
    results: dict[str, Any] = {
        "tokenizer": "replica/assets/tiny-tokenizer", "text": args.text, "prompt_chars": args.prompt_chars,
        "rendered_chars": len(sample), "tokens": len(tok.backend.encode(sample, add_special_tokens=False).ids),
        "concurrency": args.concurrency, "rounds": args.rounds, "requests_per_round": args.requests,
        "encode_alone_ms": encode_ms, "encode_beside_load_ms": beside_ms, "encodes_beside_load": encoder.count,
        "routers": {},
    }
    for name, by_case in spent.items():
        out: dict[str, float] = {}
        for case, (user, system, faults, loop, n) in by_case.items():
            out[f"{case}_cpu_ms"] = (user + system) / n * 1e3
            out[f"{case}_loop_ms"] = loop / n * 1e3
            out[f"{case}_threads_ms"] = (user + system - loop) / n * 1e3
            out[f"{case}_user_ms"] = user / n * 1e3
            out[f"{case}_system_ms"] = system / n * 1e3
            out[f"{case}_minor_faults"] = faults / n
        out["ratio_to_encode"] = out["new_cpu_ms"] / encode_ms
        out["target_ms"] = TARGET_RATIO * encode_ms + TARGET_PLUS_MS
        out["beyond_encode_ms"] = out["new_cpu_ms"] - encode_ms
        out["ratio_to_encode_beside_load"] = out["new_cpu_ms"] / beside_ms
        out["target_beside_load_ms"] = TARGET_RATIO * beside_ms + TARGET_PLUS_MS
        results["routers"][name] = out
    results["stages_ms"] = await stages(TINY_TOKENIZER, Prompts(args.prompt_chars, args.text, args.seed + 7), args.stage_prompts)
    return results


def print_table(results: dict[str, Any]) -> None:
    names = list(results["routers"])
    print(f"CPU per new prompt: {results['prompt_chars']} characters of {results['text']} text "
          f"({results['rendered_chars']} rendered, {results['tokens']} tokens, the tiny tokenizer), "
          f"closed loop at concurrency {results['concurrency']}, {results['rounds']} rounds x "
          f"{results['requests_per_round']} new prompts per router")
    print(f"{'':44}" + "".join(f"{n:>22}" for n in names))
    rows = [
        ("router CPU per new prompt (ms)", "new_cpu_ms"), ("  user / system (ms)", ("new_user_ms", "new_system_ms")),
        ("  event loop thread / other threads (ms)", ("new_loop_ms", "new_threads_ms")),
        ("  minor page faults per request", "new_minor_faults"), ("  x the encode alone", "ratio_to_encode"),
        ("  beyond the encode (ms)", "beyond_encode_ms"),
        (f"  target {TARGET_RATIO}x encode + {TARGET_PLUS_MS} ms (ms)", "target_ms"),
        ("  x the encode beside the load", "ratio_to_encode_beside_load"),
        ("  target against it (ms)", "target_beside_load_ms"),
        ("router CPU per one-line chat (ms)", "short_cpu_ms"),
        ("  user / system (ms)", ("short_user_ms", "short_system_ms")),
    ]
    for label, key in rows:
        cells = []
        for n in names:
            r = results["routers"][n]
            cells.append(" / ".join(f"{r[k]:.3f}" for k in key) if isinstance(key, tuple) else f"{r[key]:.3f}")
        print(f"{label:44}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'the encode alone, same kind of prompt (ms)':44}{results['encode_alone_ms']:>22.3f}")
    print(f"{'  beside the routers load, sampled (ms)':44}{results['encode_beside_load_ms']:>22.3f}"
          f"  ({results['encodes_beside_load']} encodes)")
    if len(names) > 1:
        base = results["routers"][names[0]]["new_cpu_ms"]
        for other in names[1:]:
            print(f"{names[0]} / {other}, new prompt CPU: {base / results['routers'][other]['new_cpu_ms']:.3f}x")
    print("\nthe router's steps in-process, ms of CPU per new prompt (this checkout)")
    for key, value in results["stages_ms"].items():
        print(f"  {key:42}{value:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.cpu_per_prompt", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=200, help="new prompts per router per round (one-line chats: twice)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the routers' order reversed every other one")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    p.add_argument("--prompt-chars", type=int, default=16_384)
    p.add_argument("--text", choices=("chat", "words"), default="chat")
    p.add_argument("--stage-prompts", type=int, default=200, help="prompts of the in-process stage timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every router (repeat: --router-arg=--no-access-log)")
    p.add_argument("--compare", action="append", default=[], metavar="CHECKOUT",
                   help="also run the router of another checkout (e.g. a worktree of main), in the same rounds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--encoder-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.encoder_child:
        encoder_child(args.text, args.prompt_chars, args.seed, ENCODER_PAUSE_S)
        return 0
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
