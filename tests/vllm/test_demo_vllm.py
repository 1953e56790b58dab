"""`kvroute demo --engine vllm` end to end: real vLLM replicas behind the router, the emulated
demo's JSON, more reuse delivered by cost_model, cold caches for each pass, and nothing left
running, whether the demo finishes, is interrupted while its replicas start, or cannot start them.

Every process the demo starts (launchers, vLLM) inherits a marker in its environment: what is
alive afterwards is found in /proc by that marker, whoever its parent is by then.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvroute.bench.demo import DEFAULTS
from kvroute.bench.demo_chat import build_workload
from kvroute.replica.vllm_fleet import FleetError, ReplicaOptions, VllmDemoFleet
from tests.vllm.support import REPO

MARK = "KVROUTE_TEST_MARK"
# A small comparison: 8 conversations, think times and arrivals at 0.4 of real time.
SMALL = ["--sessions", "8", "--session-rate", "1.5", "--time-scale", "0.4", "--seed", "3"]
EMULATED_SMALL = ["--replicas", "2", "--sessions", "4", "--session-rate", "20", "--time-scale", "0.05", "--seed", "1"]


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> command line of the live (non-zombie) processes whose environment holds ``mark``."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            stat = (proc / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


def default_sigint() -> None:
    """In the demo's process before exec: SIGINT as a terminal's Ctrl-C finds it.  A session run
    in the background of a non-interactive shell (`pytest ... &`, CI scripts) ignores SIGINT; the
    demo would inherit that, and Python leaves an ignored SIGINT ignored (no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def demo_process(vllm_python: Path, mark: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, KVROUTE_VLLM_PYTHON=str(vllm_python), **{MARK: mark})
    return subprocess.Popen([sys.executable, "-m", "kvroute.cli", "demo", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)


def kill_demo(proc: subprocess.Popen[str], mark: str) -> None:
    """A test that failed while the demo ran: SIGKILL it and what it started (its launchers would
    otherwise keep their vLLM replicas running, orphaned, after the session)."""
    proc.kill()
    proc.wait()
    for pid in marked_processes(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(mark: str, timeout: float = 10.0) -> dict[int, str]:
    """The marked processes still alive after ``timeout`` (an orphan may take a moment to exit)."""
    deadline = time.monotonic() + timeout
    while (alive := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def emulated_json_keys() -> tuple[set[str], set[str], set[str]]:
    """Top-level, per-policy and per-pass keys of the emulated demo's --json, from a tiny real run."""
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "demo", *EMULATED_SMALL, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    doc = json.loads(out)
    return set(doc), set(doc["policies"]["cost_model"]), set(doc["passes"]["cost_model"])


@pytest.mark.timeout(600)
def test_demo_vllm_json_matches_the_emulated_demo_and_leaves_nothing_running(vllm_python: Path) -> None:
    # The first conversation's first answer comes before the second conversation starts: its
    # cached tokens then say whether the pass started on cold replicas.
    workload = build_workload(3, 8, 1.5, DEFAULTS["vllm"].chat)
    assert workload.conversations[1].start_s * 0.4 > 0.5

    mark = uuid.uuid4().hex
    proc = demo_process(vllm_python, mark, "--engine", "vllm", "--json", *SMALL)
    seen: dict[int, str] = {}
    try:
        while proc.poll() is None:
            seen |= marked_processes(mark)
            time.sleep(0.5)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            kill_demo(proc, mark)
    assert proc.returncode == 0, err[-4000:]
    # The scan finds what the demo starts: two launchers, two vLLM servers (a fork caught before
    # its exec shows its parent's command line: hence at least).
    assert sum("kvroute.cli replica --engine vllm" in cmd for cmd in seen.values()) >= 2, seen
    assert sum("vllm.entrypoints.openai.api_server" in cmd for cmd in seen.values()) >= 2, seen
    assert wait_gone(mark) == {}, "the demo left processes running"

    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object, got {out!r}"
    doc = json.loads(lines[0])
    top, per_policy, per_pass = emulated_json_keys()
    assert set(doc) == top
    assert set(doc["policies"]) == {"round_robin", "cost_model"}
    assert doc["engine"] == "vllm" and doc["replicas"] == 2
    for name, m in doc["policies"].items():
        assert set(m) == per_policy, name
        assert m["requests"] == doc["requests_sent"] == workload.requests, name  # every request answered
        details = doc["passes"][name]
        assert set(details) == per_pass, name
        assert details["errors"] == 0
        assert details["first_request_cached_tokens"] == 0, f"{name} did not start on cold replicas"
        # delivered: the replicas' cached_tokens, as the client summed them and the router booked them
        assert details["router_delivered_tokens"] == round(m["reuse_delivered"] * details["prompt_tokens"])
    cost, rr = doc["policies"]["cost_model"], doc["policies"]["round_robin"]
    assert cost["reuse_delivered"] > rr["reuse_delivered"], doc["policies"]


def test_demo_vllm_interrupted_while_replicas_start_leaves_nothing_running(vllm_python: Path) -> None:
    mark = uuid.uuid4().hex
    proc = demo_process(vllm_python, mark, "--engine", "vllm", *SMALL)
    try:
        deadline = time.monotonic() + 120
        while not any("vllm.entrypoints" in cmd for cmd in marked_processes(mark).values()):
            assert proc.poll() is None and time.monotonic() < deadline, "no vLLM started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # to the demo only: it must stop what it started itself
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_demo(proc, mark)
    assert proc.returncode == 130, err[-4000:]
    assert "interrupted" in err and out == ""
    assert wait_gone(mark) == {}, "an interrupted demo left processes running"


async def test_a_fleet_whose_replicas_cannot_start_says_why_and_leaves_nothing(
    vllm_python: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # inherited by the launchers and their vLLM (not visible on us in /proc)
    monkeypatch.setenv("KVROUTE_VLLM_PYTHON", str(vllm_python))
    fleet = VllmDemoFleet(2, model="demo", logdir=tmp_path,
                          options=ReplicaOptions(extra_args=("--vllm-args=--no-such-vllm-flag",)))
    with pytest.raises(FleetError) as failure:
        await fleet.start()
    message = str(failure.value)
    assert "exited with code" in message and "before it was ready" in message
    assert "unrecognized arguments: --no-such-vllm-flag" in message  # vLLM's own complaint, from its log
    assert fleet.urls == []
    assert wait_gone(mark) == {}, "a failed start left processes running"
