"""The relay's idle timeout between a stream's chunks (skylb/balancer/relay.py ``_IdleDeadline``): one timer per
timeout period instead of one per chunk, with the same behaviour as ``asyncio.timeout`` around each read."""

from __future__ import annotations

import asyncio

import pytest

from skylb.balancer.relay import _IdleDeadline


class _Source:
    """``readany()`` answers each queued chunk after its delay (s)."""

    def __init__(self, *chunks: tuple[float, bytes]):
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        delay, chunk = self.chunks.pop(0)
        await asyncio.sleep(delay)
        return chunk


def test_reads_within_the_timeout_pass_and_time_between_reads_does_not_count():
    async def main():
        loop = asyncio.get_running_loop()
        idle = _IdleDeadline(loop, 0.2)
        source = _Source(*[(0.01, b"x")] * 5, (0.15, b"y"))
        got = []
        for _ in range(6):
            got.append(await idle.read(source))
            await asyncio.sleep(0.1)  # the client's write: 6 x 0.1 s is past the timeout, but it is not a read
        idle.close()
        return got

    assert asyncio.run(main()) == [b"x"] * 5 + [b"y"]


def test_a_read_that_stalls_raises_timeout_and_leaves_the_task_uncancelled():
    async def main():
        idle = _IdleDeadline(asyncio.get_running_loop(), 0.1)
        assert await idle.read(_Source((0.0, b"a"))) == b"a"
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await idle.read(_Source((5.0, b"never")))
        took = asyncio.get_running_loop().time() - started
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0)  # no cancellation is left pending on this task
        idle.close()
        return took

    assert 0.09 <= asyncio.run(main()) < 0.35


def test_the_handlers_own_cancellation_is_not_turned_into_a_timeout():
    async def main():
        idle = _IdleDeadline(asyncio.get_running_loop(), 10.0)
        task = asyncio.create_task(idle.read(_Source((5.0, b"never"))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        idle.close()

    asyncio.run(main())
