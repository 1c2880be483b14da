"""An inference worker's step slots follow its engine's capacity (issue 13): the figures
from a heartbeat, the supplier's waits and wakes across threads, and a real Temporal
worker that takes no more activities at once than the supplier allows."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import (
    FixedSizeSlotSupplier,
    UnsandboxedWorkflowRunner,
    Worker,
    WorkerTuner,
)

from tests.polling import eventually
from warmloop.activities.registry import EngineHeartbeat
from warmloop.workers.step_slots import (
    EngineStepSlots,
    StepSlotConfig,
    step_slots,
)
from warmloop.workflows.calibration import preset

H100 = "h100-llama-3.1-8b-bf16"


def beat(**kw: Any) -> EngineHeartbeat:
    base: dict[str, Any] = dict(engine_id="e0", task_queue="engine.e0", model="m",
                                url="http://e0", healthy=True, at=0.0)
    return EngineHeartbeat(**{**base, **kw})


def test_a_big_engine_gets_slots_for_what_it_runs_at_once_and_its_queue() -> None:
    cal = preset(H100)
    hb = beat(calibration=cal, kv_capacity_tokens=4_000_000)
    s = step_slots(hb, StepSlotConfig(floor=16, ceiling=4096, queue_share=1.0))
    # 4M tokens of KV fit far more than max_batch typical prompts: max_batch rules
    assert s.engine_seqs == cal.max_batch
    assert s.slots == 2 * cal.max_batch
    assert "max_batch" in s.reason


def test_a_small_kv_pool_limits_the_slots_to_the_prompts_it_fits() -> None:
    cal = preset(H100)
    fit = 5
    hb = beat(calibration=cal, kv_capacity_tokens=fit * cal.reference_prompt_tokens)
    s = step_slots(hb, StepSlotConfig(floor=2, ceiling=1024, queue_share=0.5))
    assert (s.kv_fit, s.engine_seqs, s.slots) == (fit, fit, 8)  # ceil(5 * 1.5)


def test_batch_steps_held_by_admission_get_slots_on_top() -> None:
    cal = preset(H100)
    hb = beat(calibration=cal, kv_capacity_tokens=4 * cal.reference_prompt_tokens,
              batch_limit=3, batch_waiting=7)
    s = step_slots(hb, StepSlotConfig(floor=1, ceiling=1024, queue_share=0.0))
    assert (s.engine_seqs, s.batch_allowance, s.slots) == (4, 10, 14)


@pytest.mark.parametrize("hb", [None, beat(healthy=False), beat()])
def test_without_a_heartbeat_or_figures_the_floor(hb: EngineHeartbeat | None) -> None:
    s = step_slots(hb, StepSlotConfig(floor=16, ceiling=64))
    assert s.slots == 16 and s.engine_seqs is None


def test_clamped_to_the_bounds() -> None:
    cal = preset(H100)
    hb = beat(calibration=cal, kv_capacity_tokens=10**9)
    assert step_slots(hb, StepSlotConfig(floor=1, ceiling=100)).slots == 100
    tiny = beat(calibration=cal, kv_capacity_tokens=cal.reference_prompt_tokens)
    assert step_slots(tiny, StepSlotConfig(floor=16, ceiling=100)).slots == 16


def test_bounds_that_contradict_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="WARMLOOP_INFERENCE_MAX_STEPS"):
        StepSlotConfig(floor=32, ceiling=8)


async def test_a_release_from_another_thread_wakes_a_waiting_reserve() -> None:
    slots = EngineStepSlots(lambda: None, StepSlotConfig(floor=1, ceiling=1))
    ctx: Any = None
    await slots.reserve_slot(ctx)
    waiting = asyncio.create_task(slots.reserve_slot(ctx))
    await asyncio.sleep(0)
    assert not waiting.done() and slots.try_reserve_slot(ctx) is None
    # Temporal's core releases slots from its own threads
    t = threading.Thread(target=slots.release_slot, args=(ctx,))
    t.start()
    t.join()
    await asyncio.wait_for(waiting, timeout=5)
    assert slots.in_use == 1


async def test_a_higher_limit_wakes_a_waiting_reserve_and_a_lower_one_takes_nothing_back(
) -> None:
    view: list[EngineHeartbeat | None] = [None]
    slots = EngineStepSlots(lambda: view[0], StepSlotConfig(floor=1, ceiling=64,
                                                            queue_share=0.0))
    ctx: Any = None
    await slots.reserve_slot(ctx)
    waiting = asyncio.create_task(slots.reserve_slot(ctx))
    await asyncio.sleep(0)
    assert not waiting.done()
    cal = preset(H100)
    view[0] = beat(calibration=cal, kv_capacity_tokens=3 * cal.reference_prompt_tokens)
    assert slots.refresh().slots == 3
    await asyncio.wait_for(waiting, timeout=5)
    view[0] = None
    assert slots.refresh().slots == 1
    assert slots.in_use == 2  # nothing running is taken away
    assert slots.try_reserve_slot(ctx) is None


# ---- a real Temporal worker honours the supplier ----------------------------------------

_running = 0
_peak = 0
_gate: asyncio.Event | None = None


@activity.defn
async def hold_a_slot(_: int) -> None:
    global _running, _peak
    _running += 1
    _peak = max(_peak, _running)
    try:
        assert _gate is not None
        await _gate.wait()
    finally:
        _running -= 1


@workflow.defn
class ManySteps:
    @workflow.run
    async def run(self, steps_queue: str) -> None:
        await asyncio.gather(*(workflow.execute_activity(
            hold_a_slot, i, task_queue=steps_queue,
            start_to_close_timeout=timedelta(seconds=120)) for i in range(6)))


async def test_a_worker_takes_no_more_steps_at_once_than_its_engine_allows(
    dev_server_env: WorkflowEnvironment,
) -> None:
    global _gate, _peak
    _gate, _peak = asyncio.Event(), 0
    view: list[EngineHeartbeat | None] = [None]
    slots = EngineStepSlots(lambda: view[0], StepSlotConfig(floor=2, ceiling=64,
                                                            queue_share=0.0))
    queue = f"slots-{uuid.uuid4().hex[:6]}"
    client = dev_server_env.client
    steps_worker = Worker(client, task_queue=queue + "-steps", activities=[hold_a_slot],
                          tuner=WorkerTuner.create_composite(
                              workflow_supplier=FixedSizeSlotSupplier(1),
                              activity_supplier=slots,
                              local_activity_supplier=FixedSizeSlotSupplier(1),
                              nexus_supplier=FixedSizeSlotSupplier(1)))
    async with steps_worker, Worker(client, task_queue=queue, workflows=[ManySteps],
                                    workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(ManySteps.run, queue + "-steps", id=queue,
                                             task_queue=queue)

        async def started(n: int) -> bool:
            d = await handle.describe()
            states = [p.state for p in d.raw_description.pending_activities]
            # 2: STARTED. The server marks an activity started when a worker takes its
            # task, a moment before the activity's body runs: wait for both.
            return (len(states) == 6 and sum(s == 2 for s in states) == n
                    and _running == n)

        await eventually(lambda: started(2), attempts=600)
        assert _running == 2 and slots.in_use == 2
        # the engine reports room for four more: the worker takes them
        cal = preset(H100)
        view[0] = beat(calibration=cal, kv_capacity_tokens=5 * cal.reference_prompt_tokens)
        slots.refresh()
        await eventually(lambda: started(5), attempts=600)
        assert _running == 5
        _gate.set()
        await handle.result()
    assert _peak == 5 and slots.in_use <= 1  # idle pollers may hold a reserved slot
