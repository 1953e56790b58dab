"""Child processes of the benchmarks: started until they print their URL, stopped together."""

from __future__ import annotations

import asyncio
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def spawn(args: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``args`` in the repository; returns it and the first http:// word of its first line."""
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, cwd=str(REPO))
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
