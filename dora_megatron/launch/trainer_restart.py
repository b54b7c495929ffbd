"""A lost trainer is restarted inside the job, from the last complete checkpoint.

The rule (local jobs and SLURM jobs alike): the controller counts the trainer as lost when its
process exits, when a call to it is dropped, or when its ``/health`` stays silent for
``controller.trainer_timeout_s`` (:func:`watch_trainer`; the trainer answers it during a step).
The rollout instances keep running. The launcher then restarts the trainer from the newest
complete checkpoint (:func:`restart_point`; the initial weights when there is none) and runs the
controller again from the same checkpoint, up to ``launch.max_trainer_restarts`` times
(:func:`run_restarting`); when none is left the job fails naming the cause (under SLURM: FAILED),
and ``--resume`` continues it.

Under SLURM the controller restarts the part of the trainer on its own node (its child); a trainer
that spans several nodes is restarted on the others by their own launchers, asked through a
request file in the shared run directory (:func:`request_restart` / :func:`restart_requested`).
A part that dies on another node is reported the other way, by a notice its node writes there
(:func:`report_part_lost`, watched by :func:`watch_trainer_parts`): the ranks left wait for it in a
collective and rank 0 goes on answering ``/health``, so only its node sees the loss.

WHY the resume path and not a second mechanism: a checkpoint is a cut where weights ``v`` exist
and the orchestrator has not reacted to them, and ``--resume`` from it is already exactly-once
(the crashed lineage's steps after the cut are dropped from ``consumed.jsonl`` and trained again;
finished samples of the cut's groups come back from the journal). A restart inside the job is the
same resume with the engine processes kept: no process reloads a model. C1 holds because the
restored orchestrator knows only the cut's groups, all of versions <= the cut: samples of newer
versions (which the re-trained lineage will produce differently) belong to groups it never saw,
are aborted with everything in flight, and are never restored; every instance is switched to a
version the cut assigns (the Resume event), or, without a checkpoint, reloads the initial weights
(:func:`reset_engines`) before the fresh start that assumes them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

from dora_megatron.processes import ChildFailed

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.processes import ProcessSet

log = logging.getLogger(__name__)


class TrainerLost(ChildFailed):
    """The trainer died or stopped answering (not: it answered with an error, which a restart
    would only repeat). The job may restart it (:func:`run_restarting`)."""


async def watch_trainer(health: Callable[[], Awaitable[Any]], timeout_s: float,
                        on_lost: Callable[[TrainerLost], None], poll_s: float | None = None,
                        clock: Callable[[], float] = time.monotonic) -> None:
    """Poll ``health()`` (None: no answer) every ``poll_s`` (default: a quarter of ``timeout_s``, at
    most 5 s); once it has not answered for ``timeout_s``, call ``on_lost`` once and return.

    WHY a watchdog beside the process watch: a trainer on another node, or one hung in a collective,
    neither exits nor drops a connection; a call to it would wait for its HTTP timeout (an hour)."""
    poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
    last_answer = clock()
    while True:
        await asyncio.sleep(poll_s)
        if await health() is not None:
            last_answer = clock()
        elif clock() - last_answer >= timeout_s:
            on_lost(TrainerLost(f"the trainer did not answer /health for {clock() - last_answer:.0f} s "
                                f"(controller.trainer_timeout_s={timeout_s:g})"))
            return


@dataclass
class TrainerRestarts:
    """The job's budget of trainer restarts (``launch.max_trainer_restarts``) and why each was used."""

    max_restarts: int
    reasons: list[str] = field(default_factory=list)

    @property
    def used(self) -> int:
        return len(self.reasons)

    def take(self, err: BaseException) -> bool:
        """Use one restart for ``err``; False when none is left."""
        if self.used >= self.max_restarts:
            return False
        self.reasons.append(str(err).splitlines()[0] if str(err) else type(err).__name__)
        return True

    def spent(self, err: BaseException) -> TrainerLost:
        """The error that ends the job: the cause first, then the budget."""
        head, _, rest = str(err).partition("\n")
        return TrainerLost(f"{head}; no trainer restart left (launch.max_trainer_restarts={self.max_restarts}, "
                           f"{self.used} used)" + (f"\n{rest}" if rest else ""))


def run_restarting(run_once: Callable[[Path | None], dict[str, Any]],
                   restart: Callable[[TrainerLost], Path | None], checkpoint: Path | None,
                   budget: TrainerRestarts) -> dict[str, Any]:
    """``run_once(checkpoint)`` until it returns; each :class:`TrainerLost` it raises takes one
    restart from ``budget``: ``restart(err)`` brings the trainer back and returns the checkpoint
    the next run starts from (None: the initial weights). Raises :meth:`TrainerRestarts.spent`
    once the budget is used up; any other error passes through."""
    while True:
        try:
            return run_once(checkpoint)
        except TrainerLost as err:
            if not budget.take(err):
                raise budget.spent(err) from err
            log.warning("trainer lost (%s): restart %d of %d", budget.reasons[-1], budget.used, budget.max_restarts)
            checkpoint = restart(err)


def restart_point(run_dir: Path, say: Callable[[str], None], quarantine: bool = True) -> Path | None:
    """The checkpoint a restarted trainer loads: the newest complete one that passes its manifest
    (one being written when the trainer died has no ``controller.json`` and is skipped), None when
    there is none (the restart starts from the initial weights)."""
    from dora_megatron.controller.checkpoint_manifest import choose_checkpoint

    return choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=say,
                             quarantine=quarantine).checkpoint


def trainer_argv(argv: Sequence[str], checkpoint: Path | None) -> list[str]:
    """The trainer's command line to start from ``checkpoint`` (its ``trainer`` part) instead of
    what ``argv`` loaded (a ``--resume`` in it is replaced; None: the initial weights)."""
    out = list(argv)
    if "--resume" in out:
        i = out.index("--resume")
        del out[i:i + 2]
    return out + (["--resume", str(checkpoint / "trainer")] if checkpoint is not None else [])


async def reset_engines(engines: dict[str, Any], model_dir: Path) -> list[str]:
    """Load the initial weights (version 0) on every instance of ``engines`` (name -> client):
    a start without a checkpoint assumes them there, and the instances kept from the lost lineage
    hold newer ones. Returns the names that could not be reset (they stay in the pool, and the
    run fails them at their first request, as any unreachable instance)."""
    async def one(name: str, engine: Any) -> str | None:
        try:
            await engine.update_weights_from_disk(str(model_dir), weight_version=0)
        except Exception as err:  # noqa: BLE001 - named to the caller; the run's own checks fail it
            log.warning("%s: loading the initial weights after the trainer restart failed: %s", name, err)
            return name
        return None

    failed = await asyncio.gather(*(one(n, e) for n, e in engines.items()))
    return sorted(n for n in failed if n is not None)


def restart_trainer(cfg: "DoraConfig", procs: "ProcessSet", engine_urls: Mapping[str, str], run_dir: Path,
                    model_dir: Path, err: TrainerLost, budget: TrainerRestarts, say: Callable[[str], None], *,
                    before_start: Callable[[Path | None], None] | None = None,
                    on_started: Callable[[], None] | None = None) -> Path | None:
    """Bring back the trainer child ``trainer`` of ``procs`` after it was lost (``err``): the newest
    complete checkpoint is chosen, torchrun restarts from it (its whole process group killed first),
    and without one every kept instance (``engine_urls``) reloads the initial weights. Returns the
    checkpoint the controller restarts from. ``before_start(checkpoint)``: runs before the new
    trainer starts (SLURM: ask the other trainer nodes to restart theirs from the same one);
    ``on_started``: after (local: rewrite ``processes.json``)."""
    checkpoint = restart_point(run_dir, say)
    where = f"checkpoint {checkpoint.name}" if checkpoint is not None else "the initial weights (no complete checkpoint)"
    say(f"trainer lost: {str(err).splitlines()[0]}; restarting it from {where} "
        f"(restart {budget.used} of launch.max_trainer_restarts={budget.max_restarts}); the rollout instances keep running")
    if before_start is not None:
        before_start(checkpoint)
    old = next(c for c in procs.children if c.name == "trainer")
    procs.restart("trainer", trainer_argv(old.argv, checkpoint))
    if on_started is not None:
        on_started()
    if checkpoint is None:
        from dora_megatron.rollout.factory import engine_for

        clients = {n: engine_for(cfg, url, str(model_dir), procs, run_dir) for n, url in engine_urls.items()}

        async def reset() -> list[str]:
            try:
                return await reset_engines(clients, model_dir)
            finally:
                for c in clients.values():
                    await c.close()

        failed = asyncio.run(reset())
        if failed:
            say(f"could not reload the initial weights on {', '.join(failed)}: they are failed at their first request")
    return checkpoint


RESTART_REQUEST = "trainer_restart.json"


@dataclass(frozen=True)
class RestartRequest:
    """The controller's request to the other trainer nodes of a SLURM job: restart your part of the
    trainer from ``checkpoint`` (None: the initial weights). ``number`` counts the job's restarts
    (a node acts on each number once); ``job_id`` keeps a resumed job from acting on the request
    of the job it resumes."""

    job_id: str
    number: int
    checkpoint: Path | None


def request_restart(run_dir: Path, req: RestartRequest) -> None:
    """Write ``req`` (atomically: a node polling the file never reads half of it)."""
    import json
    import os

    tmp = run_dir / f".{RESTART_REQUEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"job": req.job_id, "number": req.number,
                               "checkpoint": None if req.checkpoint is None else str(req.checkpoint)}))
    os.replace(tmp, run_dir / RESTART_REQUEST)


def restart_requested(run_dir: Path, job_id: str, done: int) -> RestartRequest | None:
    """The request of job ``job_id`` newer than restart number ``done`` this node carried out, if any."""
    import json

    try:
        d = json.loads((run_dir / RESTART_REQUEST).read_text())
        req = RestartRequest(str(d["job"]), int(d["number"]), None if d["checkpoint"] is None else Path(d["checkpoint"]))
    except (OSError, ValueError, KeyError, TypeError):  # none yet (a malformed one is never written: atomic)
        return None
    return req if req.job_id == job_id and req.number > done else None


PART_LOST = "trainer_lost.{node}.json"


@dataclass(frozen=True)
class PartLost:
    """A trainer node's notice to the controller: its part of the trainer died (``reason``).

    WHY a notice and not the controller's own watch: the surviving ranks of a trainer spanning
    nodes wait in a collective for the dead one (the process group's timeout, 30 minutes) while
    rank 0 still answers ``/health``, so neither the controller's process watch nor its watchdog
    sees the loss. ``lineage``: the restart requests the node had carried out when its part died
    (the controller acts on a notice of its current lineage only: one written before a restart is
    stale after it); ``job_id`` keeps a resumed job from acting on the notice of the job it resumes."""

    job_id: str
    lineage: int
    node: str
    reason: str


def report_part_lost(run_dir: Path, notice: PartLost) -> None:
    """Write ``notice`` (one file per node, atomically: a later notice of another node replaces nothing)."""
    import json
    import os

    path = run_dir / PART_LOST.format(node=notice.node)
    tmp = run_dir / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"job": notice.job_id, "lineage": notice.lineage, "node": notice.node,
                               "reason": notice.reason}))
    os.replace(tmp, path)


def parts_lost(run_dir: Path, job_id: str, lineage: int) -> list[PartLost]:
    """The notices of job ``job_id`` about trainer lineage ``lineage`` (restarts so far), by node."""
    import json

    found = []
    for path in sorted(run_dir.glob(PART_LOST.format(node="*"))):
        try:
            d = json.loads(path.read_text())
            notice = PartLost(str(d["job"]), int(d["lineage"]), str(d["node"]), str(d["reason"]))
        except (OSError, ValueError, KeyError, TypeError):  # removed meanwhile (never half-written: atomic)
            continue
        if notice.job_id == job_id and notice.lineage == lineage:
            found.append(notice)
    return found


def part_lost_error(run_dir: Path, job_id: str, lineage: int) -> TrainerLost | None:
    """The loss a notice of this lineage reports (the first node's), None without one."""
    found = parts_lost(run_dir, job_id, lineage)
    return TrainerLost(f"the trainer's part on {found[0].node} died: {found[0].reason}") if found else None


async def watch_trainer_parts(run_dir: Path, job_id: str, lineage: int, on_lost: Callable[[TrainerLost], None],
                              poll_s: float = 1.0) -> None:
    """Poll for a notice of the trainer's other nodes (:func:`report_part_lost`) about this
    lineage; on the first, call ``on_lost`` once (the trainer is lost: it is restarted whole) and return."""
    on_lost(await wait_part_lost(run_dir, job_id, lineage, math.inf, poll_s))


async def wait_part_lost(run_dir: Path, job_id: str, lineage: int, timeout_s: float,
                         poll_s: float = 0.2) -> TrainerLost | None:
    """Wait at most ``timeout_s`` for a notice of this lineage (None: none came).

    WHY: a rank whose peer on another node died may fail its collective (gloo: "Connection closed by
    peer") and answer the call with that error while it lives on; the peer's node reports the death
    within its poll period, and only that notice tells the loss from an error a restart would repeat."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        lost = part_lost_error(run_dir, job_id, lineage)
        if lost is not None or asyncio.get_running_loop().time() >= deadline:
            return lost
        await asyncio.sleep(poll_s)
