from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mcp_edge.agent.runtime.batcher import (
    BatchingConfig,
    DeadlineExceededError,
    DynamicBatcher,
    OverloadedError,
    Priority,
)
from tests.support.runners import DoublingRunner


def _x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), value, dtype=np.float32)}


async def _wait_entered(runner: DoublingRunner) -> None:
    await asyncio.to_thread(runner.entered.wait, 10)


async def test_requests_queued_behind_a_busy_instance_are_batched_and_split_back() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=16, inline_below_s=0))
    first = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(runner)
    rest = [asyncio.create_task(batcher.infer(_x(i, rows=1 + i % 2))) for i in range(1, 11)]
    await asyncio.sleep(0)
    runner.gate.set()
    results = await asyncio.gather(first, *rest)
    for i, out in enumerate(results):
        assert out["y"].shape == (1 + i % 2 if i else 1, 4)
        assert np.all(out["y"] == 2 * i)
    assert runner.batches[0] == 1
    assert max(runner.batches) > 1  # queued requests were stacked into one run
    assert sum(runner.batches) == 1 + sum(1 + i % 2 for i in range(1, 11))
    await batcher.close()


async def test_batching_off_runs_each_request_alone() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=1, inline_below_s=0))
    tasks = [asyncio.create_task(batcher.infer(_x(i))) for i in range(6)]
    await _wait_entered(runner)
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert runner.batches == [1] * 6
    await batcher.close()


async def test_high_priority_overtakes_queued_low_priority() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=1, inline_below_s=0))
    blocker = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(runner)
    order: list[str] = []

    async def tagged(tag: str, prio: Priority) -> None:
        await batcher.infer(_x(1), priority=prio)
        order.append(tag)

    tasks = [asyncio.create_task(tagged(f"low{i}", Priority.LOW)) for i in range(3)]
    tasks.append(asyncio.create_task(tagged("high", Priority.HIGH)))
    await asyncio.sleep(0)
    runner.gate.set()
    await asyncio.gather(blocker, *tasks)
    assert order[0] == "high"
    await batcher.close()


async def test_full_queue_is_refused_at_once_with_retry_after() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher(
        [runner], BatchingConfig(max_batch_size=1, max_queue=3, inline_below_s=0)
    )
    running = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(runner)
    queued = [asyncio.create_task(batcher.infer(_x(1))) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError) as info:
        await batcher.infer(_x(2))
    assert info.value.retry_after_s >= 1
    runner.gate.set()
    await asyncio.gather(running, *queued)
    await batcher.close()


async def test_deadline_exceeded_while_queued() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=1, inline_below_s=0))
    running = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(runner)
    with pytest.raises(DeadlineExceededError):
        await batcher.infer(_x(1), timeout_s=0.05)
    runner.gate.set()
    await running
    await batcher.close()
    assert runner.batches == [1]  # the expired request never ran


async def test_work_spreads_over_instances_and_close_drains() -> None:
    a, b = DoublingRunner(), DoublingRunner()
    a.gate.clear()
    batcher = DynamicBatcher([a, b], BatchingConfig(max_batch_size=1, inline_below_s=0))
    held = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(a)
    # a is busy: the next request must go to b, not wait behind a.
    out = await batcher.infer(_x(3))
    assert np.all(out["y"] == 6) and b.batches == [1]
    closing = asyncio.create_task(batcher.close())
    await asyncio.sleep(0)
    a.gate.set()
    await closing
    assert (await held)["y"].shape == (1, 4)


async def test_mismatched_trailing_shapes_are_not_stacked() -> None:
    runner = DoublingRunner()
    runner.gate.clear()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=8, inline_below_s=0))
    first = asyncio.create_task(batcher.infer(_x(0)))
    await _wait_entered(runner)
    odd = asyncio.create_task(batcher.infer({"x": np.ones((1, 2), np.float32)}))
    same = [asyncio.create_task(batcher.infer(_x(1))) for _ in range(2)]
    await asyncio.sleep(0)
    runner.gate.set()
    await asyncio.gather(first, *same)
    assert (await odd)["y"].shape == (1, 2)
    await batcher.close()


async def test_tiny_batches_run_inline_and_slow_ones_on_worker_threads() -> None:
    import threading

    threads: list[int] = []

    class Recording(DoublingRunner):
        def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            threads.append(threading.get_ident())
            return super().run(feeds)

    runner = Recording()
    batcher = DynamicBatcher([runner], BatchingConfig(max_batch_size=8, inline_below_s=1.0))
    for i in range(3):
        assert np.all((await batcher.infer(_x(i)))["y"] == 2 * i)
    main = threading.get_ident()
    # The first run has no measured cost yet: it goes to a worker thread; then inline.
    assert threads[0] != main and threads[1:] == [main, main]
    await batcher.close()
    threads.clear()
    never_inline = DynamicBatcher([runner], BatchingConfig(max_batch_size=8, inline_below_s=0))
    for i in range(3):
        await never_inline.infer(_x(i))
    assert main not in threads
    await never_inline.close()
