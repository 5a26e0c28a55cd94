"""The gateway's fair line on an event loop, without HTTP: the capacity bound, who goes next when a slot
frees, the per-key bound (429) and the overall one (503), the queue timeout, a waiter that leaves, and
the estimate settled from the usage."""

from __future__ import annotations

import asyncio

import pytest

from elastune_contract.openai_api.errors import APIError
from elastune_gateway.server.fair_line import FairLine, Ticket


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_requests_beyond_capacity_wait_and_the_light_key_goes_first() -> None:
    async def main() -> list[str]:
        line = FairLine(max_per_key=10, max_total=100, timeout_s=10, retry_after_s=3)
        cap = lambda: 1  # noqa: E731
        first = await line.enter("m", "flood", 10, 10, cap)
        order: list[str] = []

        async def wait(client: str, tag: str) -> None:
            ticket = await line.enter("m", client, 10, 10, cap)
            order.append(tag)
            await asyncio.sleep(0)
            ticket.release()

        tasks = [asyncio.create_task(wait("flood", f"f{i}")) for i in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("light", "l0")))
        await asyncio.sleep(0)
        assert line.active("m") == 1 and line.queued() == 5
        first.release()
        await asyncio.gather(*tasks)
        return order

    assert run(main()) == ["l0", "f0", "f1", "f2", "f3"]


def test_bounds_per_key_429_and_overall_503_with_retry_after() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=2, max_total=3, timeout_s=10, retry_after_s=7)
        cap = lambda: 1  # noqa: E731
        held = await line.enter("m", "a", 1, 1, cap)
        waiters = [asyncio.create_task(line.enter("m", "a", 1, 1, cap)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await line.enter("m", "a", 1, 1, cap)
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "7"
        assert "a" in info.value.message
        waiters.append(asyncio.create_task(line.enter("m", "b", 1, 1, cap)))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await line.enter("m", "c", 1, 1, cap)
        assert info.value.status == 503 and info.value.headers["Retry-After"] == "7"
        held.release()

        async def served(w: asyncio.Task[Ticket]) -> None:
            (await w).release()

        await asyncio.gather(*(served(w) for w in waiters))
        assert line.active("m") == 0 and line.queued() == 0

    run(main())


def test_a_request_waits_at_most_the_timeout_then_503_and_leaves_the_line() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=5, max_total=5, timeout_s=0.05, retry_after_s=1)
        held = await line.enter("m", "a", 1, 1, lambda: 1)
        with pytest.raises(APIError) as info:
            await line.enter("m", "b", 1, 1, lambda: 1)
        assert info.value.status == 503
        assert line.queued() == 0
        held.release()
        assert line.active("m") == 0

    run(main())


def test_a_cancelled_waiter_leaves_no_slot_taken() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=5, max_total=5, timeout_s=10, retry_after_s=1)
        held = await line.enter("m", "a", 1, 1, lambda: 1)
        waiter = asyncio.create_task(line.enter("m", "b", 1, 1, lambda: 1))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert line.queued() == 0
        held.release()
        held.release()  # a second release is a no-op
        assert line.active("m") == 0

    run(main())


def test_capacity_none_lets_everything_through_and_refresh_admits_after_growth() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=5, max_total=5, timeout_s=10, retry_after_s=1)
        tickets = [await line.enter("free", "a", 1, 1, lambda: None) for _ in range(8)]
        assert line.active("free") == 8
        capacity = [1]
        held = await line.enter("m", "a", 1, 1, lambda: capacity[0])
        waiter = asyncio.create_task(line.enter("m", "b", 1, 1, lambda: capacity[0]))
        await asyncio.sleep(0)
        assert not waiter.done()
        capacity[0] = 2  # a second endpoint came up
        line.refresh()
        ticket: Ticket = await waiter
        assert line.active("m") == 2
        for t in [*tickets, held, ticket]:
            t.release()

    run(main())


def test_settle_corrects_the_estimate_once() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=5, max_total=5, timeout_s=10, retry_after_s=1)
        ticket = await line.enter("m", "a", 10, 16, lambda: 4)
        queue = line.queue("m")
        assert queue.counter("a") == queue.cost(10, 16)
        ticket.settle(12, 3)
        ticket.settle(12, 3)
        assert queue.counter("a") == queue.cost(12, 3)
        ticket.release()

    run(main())


def test_a_flooding_key_leaves_a_slot_free_while_another_key_is_active() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=50, max_total=50, timeout_s=10, retry_after_s=1)
        cap = lambda: 4  # noqa: E731
        (await line.enter("m", "light", 1, 1, cap)).release()  # light was active a moment ago
        flood = [asyncio.create_task(line.enter("m", "flood", 1, 1, cap)) for _ in range(6)]
        await asyncio.sleep(0)
        assert line.active("m") == 3 and line.queued() == 3  # one slot kept for the light key
        light = await asyncio.wait_for(line.enter("m", "light", 1, 1, cap), 1)  # no wait for a slot
        assert line.active("m") == 4
        light.release()
        assert line.active("m") == 3  # the freed slot is not the flood's
        for t in flood[:3]:
            (await t).release()
        for t in flood[3:]:
            (await t).release()

    run(main())


def test_alone_a_key_gets_every_slot() -> None:
    async def main() -> None:
        line = FairLine(max_per_key=50, max_total=50, timeout_s=10, retry_after_s=1)
        tickets = [await line.enter("m", "flood", 1, 1, lambda: 4) for _ in range(4)]
        assert line.active("m") == 4
        for t in tickets:
            t.release()

    run(main())
