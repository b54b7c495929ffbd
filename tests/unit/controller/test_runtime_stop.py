"""A stop asked from outside (the launcher's first SIGINT/SIGTERM/SIGUSR1), on the real runtime
with fake engines and trainer: a checkpoint at the next step boundary although
``checkpoint_interval`` is 0, the run ends there, and a resume from it trains every remaining
group exactly once; a step that does not end within ``stop_checkpoint_timeout_s`` is abandoned
(no new checkpoint, the run still ends)."""

from __future__ import annotations

import asyncio

from dora_megatron.config.controller import ControllerConfig
from dora_megatron.controller.main import drive

from tests.helpers.runtime import ck_dir, make, resume


async def _run_and_stop_after(rt, steps: int) -> dict:
    async def stop_later() -> None:
        while rt.training.steps_done < steps:
            await asyncio.sleep(0.002)
        rt.training.request_stop("SIGINT")
        rt.training.request_stop("SIGTERM")  # a second request changes nothing (the launcher exits on a second signal)

    stopper = asyncio.get_running_loop().create_task(stop_later())
    summary = await drive(rt)
    await stopper
    return summary


def test_a_stop_checkpoints_at_the_next_boundary_and_the_resume_trains_each_group_once(tmp_path):
    n = 12
    rt, engines, trainer = make(mode="dora", steps=n, tmp_path=tmp_path, checkpoint_interval=0)
    summary = asyncio.run(_run_and_stop_after(rt, 2))
    k = summary["stop_checkpoint"]
    assert summary["status"] == "stopped" and summary["stopped_by"] == "SIGINT"
    assert 2 <= k < n and rt.training.steps_done == k == len(trainer.batches)
    written = sorted(p for p in (tmp_path / "checkpoints").glob("v*") if (p / "controller.json").is_file())
    assert written == [ck_dir(tmp_path, k)]  # the stop's checkpoint only (interval 0)

    rt2, engines2, trainer2 = make(mode="dora", steps=n, tmp_path=tmp_path, checkpoint_interval=0, resume_from=k)
    resume(rt2, trainer2, tmp_path, k)
    summary2 = asyncio.run(drive(rt2))
    assert summary2["status"] == "completed" and summary2["stopped_by"] is None
    assert len(trainer2.batches) == n - k
    groups = [s.group_id for b in trainer.batches + trainer2.batches for s in b[::2]]  # G=2: one per group
    assert len(groups) == len(set(groups)) == n * 4
    assert summary2["lost_groups"] == 0 and summary2["duplicated_groups"] == 0


def test_a_step_that_outlasts_the_stop_timeout_is_abandoned(tmp_path):
    rt, engines, trainer = make(mode="dora", steps=12, tmp_path=tmp_path, checkpoint_interval=0,
                                controller=ControllerConfig(stop_checkpoint_timeout_s=0.2))
    held = {"go": False}
    trainer.hold_step(2, until=lambda: held["go"], limit_s=30)

    async def main() -> dict:
        async def stop_while_held() -> None:
            while trainer.holding != 2:  # inside step 2, not at the boundary before it
                await asyncio.sleep(0.002)
            rt.training.request_stop("SIGTERM")

        stopper = asyncio.get_running_loop().create_task(stop_while_held())
        t0 = asyncio.get_running_loop().time()
        summary = await drive(rt)
        await stopper
        summary["elapsed"] = asyncio.get_running_loop().time() - t0
        return summary

    summary = asyncio.run(main())
    assert summary["status"] == "stopped_without_checkpoint" and summary["stop_checkpoint"] is None
    assert summary["stopped_by"] == "SIGTERM" and summary["elapsed"] < 10  # the held step was not waited for
    assert rt.training.steps_done == 2 and len(trainer.batches) == 2
    assert not [p for p in tmp_path.glob("checkpoints/v*") if (p / "controller.json").is_file()]
