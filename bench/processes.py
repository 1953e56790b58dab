"""Child processes of the benchmarks: started until they print their URL, stopped together."""

from __future__ import annotations

import asyncio
import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def spawn(args: list[str], env: dict[str, str] | None = None) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``args`` in the repository (in ``env``, default this one's); returns it and the first
    http:// word of its first line."""
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, cwd=str(REPO), env=env)
    assert proc.stdout is not None
    words = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
    url = next((word for word in words if word.startswith("http://")), None)
    if url is None:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{' '.join(args[:6])} did not start")
    return proc, url


async def stop_all(procs: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM each, then SIGKILL what has not exited 15 s later."""
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def checkout_command(checkout: Path, links: Path) -> tuple[list[str], dict[str, str]]:
    """``python -m`` the `kvroute` command of another checkout (a change's before, say), and the
    environment in which it imports that checkout's code, not this one's installed code.

    Its packages are linked into a kvroute namespace under ``links`` (the folders its pyproject's
    package-dir names), which PYTHONPATH puts ahead of any installed kvroute.  A checkout from
    before the namespace (no package-dir: router/, replica/, bench/ were top-level packages) is
    itself on PYTHONPATH.
    """
    setuptools = tomllib.loads((checkout / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    if "package-dir" not in setuptools:
        return [sys.executable, "-m", "router.cli"], {**os.environ, "PYTHONPATH": str(checkout)}
    for package, folder in setuptools["package-dir"].items():
        link = links.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(checkout / folder, target_is_directory=True)
    return [sys.executable, "-m", "kvroute.cli"], {**os.environ, "PYTHONPATH": str(links)}
