"""router/aio.py: cancelling tasks that may lose a cancellation (Python 3.11's wait_for)."""

from __future__ import annotations

import asyncio

from kvroute.router.aio import cancel_and_wait


async def test_a_task_that_loses_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    swallowed = 0

    async def forgetful() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed < 2:  # what wait_for does when its call completes as the cancel lands
                    swallowed += 1
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    continue
                raise

    tasks = [asyncio.create_task(forgetful()), asyncio.create_task(asyncio.sleep(3600))]
    await asyncio.sleep(0)
    await cancel_and_wait(tasks)
    assert swallowed == 2 and all(t.cancelled() for t in tasks)


async def test_finished_tasks_and_no_tasks_return_at_once() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await asyncio.wait_for(cancel_and_wait([done]), 1)
    await asyncio.wait_for(cancel_and_wait([]), 1)
    assert done.done() and not done.cancelled()
