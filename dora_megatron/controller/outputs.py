"""A run's outputs beside the controller: the step records (``steps.jsonl``, ``consumed.jsonl``),
TensorBoard / W&B, the progress line, checkpoint overviews, weight snapshot retention, and at the
end ``summary.json``, ``orchestrator_state.json``, the Hugging Face export and the timeline.

WHY a module of its own: every launcher (local, a SLURM job's controller node, ``dora bench``,
``tools/controller_scale.py``) runs the controller through :mod:`.main` and gets the same outputs;
they depend on the run directory and the orchestrator, never on how the processes were started.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping, Never, Sequence, TypedDict

from dora_megatron.config.schema import DoraConfig
from dora_megatron.observability.summary import StepRecord, write_summary
from dora_megatron.observability.tensorboard import ScalarWriter

if TYPE_CHECKING:
    from tqdm import tqdm

    from dora_megatron.observability.overview import CheckpointOverviews
    from dora_megatron.observability.recorder import MetricsRecorder
    from dora_megatron.observability.wandb_writer import WandbWriter
    from dora_megatron.orchestrator import Orchestrator

log = logging.getLogger(__name__)


def steps_done_at(checkpoint: Path) -> int:
    """Training steps finished at ``checkpoint``: its version (step ``t`` produces version ``t + 1``)."""
    return int(json.loads((checkpoint / "controller.json").read_text())["version"])


def drop_steps_from(path: Path, first: int) -> int:
    """Remove the lines of steps >= ``first`` from a step record (``steps.jsonl``, ``consumed.jsonl``;
    atomically): the crashed lineage's steps after the checkpoint, which the resumed run does
    again. Returns how many."""
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text().splitlines():
        try:
            keep = int(json.loads(line)["step"]) < first
        except (ValueError, KeyError, TypeError):  # a line torn by the crash: not a step record
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)
    return dropped


def open_run_records(run_dir: Path, resumed_at: int | None) -> tuple[IO[str], IO[str]]:
    """``steps.jsonl`` and ``consumed.jsonl`` opened for this run's steps: new files, or on a resume
    from the checkpoint of version ``resumed_at`` the existing ones without the crashed lineage's
    records of steps >= it (those steps are trained again from the checkpoint, on the groups it
    kept: left in, they would list those groups twice). Each step of the final lineage is then
    recorded once (``steps.jsonl`` carries each step's record, which the summary's
    ``duplicated_groups`` counts over)."""
    if resumed_at is None:
        return open(run_dir / "steps.jsonl", "w"), open(run_dir / "consumed.jsonl", "w")
    drop_steps_from(run_dir / "steps.jsonl", resumed_at)
    drop_steps_from(run_dir / "consumed.jsonl", resumed_at)
    return open(run_dir / "steps.jsonl", "a"), open(run_dir / "consumed.jsonl", "a")


class EarlierSteps(TypedDict):
    """What a resumed run's :class:`~dora_megatron.observability.overview.CheckpointOverviews` starts
    from (its keyword arguments of these names)."""

    rows: list[dict[str, Any]]  # steps.jsonl's rows of the steps before the checkpoint
    staleness: dict[int, int]  # staleness -> groups consumed at it by those steps


def earlier_steps(run_dir: Path) -> EarlierSteps:
    """A resumed run's step rows and staleness histogram before the checkpoint (``steps.jsonl``
    already cut at it, ``consumed.jsonl``), to seed :class:`CheckpointOverviews`."""
    from dora_megatron.observability.overview import read_steps

    rows = read_steps(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").is_file() else []
    done = {int(r["step"]) for r in rows}
    hist: dict[int, int] = {}
    path = run_dir / "consumed.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the crash
            continue
        if int(entry.get("step", -1)) in done:
            for v in entry.get("versions", ()):
                hist[int(entry["step"]) - int(v)] = hist.get(int(entry["step"]) - int(v), 0) + 1
    return {"rows": rows, "staleness": hist}


class RunOutputs:
    """The sinks of one controller run in ``run_dir``; ``checkpoint``: the one it resumed from.
    ``trainer_restarts``: a trainer restarted without a checkpoint re-does every step, so the lost
    lineage's TensorBoard scalars are hidden from step 0."""

    def __init__(self, cfg: DoraConfig, run_dir: Path, checkpoint: Path | None, trainer_restarts: int) -> None:
        from dora_megatron.observability.background import BackgroundWriter
        from dora_megatron.observability.recorder import StepsJsonl
        from dora_megatron.observability.tensorboard import NullWriter, TensorBoardWriter
        from dora_megatron.observability.timeline import Timeline

        obs = cfg.observability
        self.cfg, self.run_dir = cfg, run_dir
        resumed_at = steps_done_at(checkpoint) if checkpoint is not None else None  # steps >= it are re-done
        purge = resumed_at if checkpoint is not None else (0 if trainer_restarts else None)
        self.writer: ScalarWriter = (TensorBoardWriter(run_dir / "tb", purge_step=purge) if obs.tensorboard
                                     else NullWriter())
        # the slow writes of the run (rollout dumps, checkpoint overviews) run here, off the event loop
        self.background = BackgroundWriter()
        self.timeline = Timeline() if obs.timeline else None
        self.progress = Progress(cfg.run.steps, enabled=obs.progress)
        self.steps_file, self.consumed_file = open_run_records(run_dir, resumed_at)
        self.overviews: CheckpointOverviews | None = None  # overview.png at each checkpoint, drawn on the background writer
        if obs.overview and cfg.run.checkpoint_interval > 0:
            from dora_megatron.observability.overview import CheckpointOverviews

            seed = earlier_steps(run_dir) if checkpoint is not None else EarlierSteps(rows=[], staleness={})
            self.overviews = CheckpointOverviews(
                run_dir / "overview.png", self.background, max_staleness=cfg.orchestrator.max_staleness,
                title=f"{cfg.orchestrator.mode}: run overview ({run_dir.name})", **seed)
        self._orch: Orchestrator | None = None  # set by :meth:`attach` (the retention asks it for the live versions)
        self.retention = SnapshotRetention(run_dir, lambda: self.orch.live_versions())
        self.wandb: WandbWriter | None = None
        if obs.wandb:
            from dora_megatron.config.loader import to_dict
            from dora_megatron.observability.wandb_writer import WandbWriter

            self.wandb = WandbWriter(run_dir, obs.wandb_project, config=to_dict(cfg))
        #: where the metrics recorder writes each step's scalars
        self.sinks: list[ScalarWriter] = [self.writer, StepsJsonl(self.steps_file),
                                          *([self.wandb] if self.wandb is not None else [])]

    @property
    def orch(self) -> Orchestrator:
        """The run's orchestrator, once :meth:`attach` gave it."""
        if self._orch is None:
            raise RuntimeError("RunOutputs.attach(orchestrator) was not called: the outputs have no orchestrator")
        return self._orch

    def attach(self, orch: Orchestrator, resumed: bool) -> None:
        """The controller is built: its orchestrator's live versions bound the snapshot retention."""
        self._orch = orch
        if self.cfg.run.checkpoint_interval == 0:  # no mid-run checkpoint to resume from: only live versions matter
            self.retention.min_live_at_checkpoint = float("inf")
        if resumed:
            self.retention.min_live_at_checkpoint = min(orch.live_versions())

    def on_step(self, s: StepRecord, metrics: MetricsRecorder) -> None:
        """After each step (its record; ``metrics``: the run's recorder): prune snapshots, record the
        consumed groups, progress, overview."""
        self.retention.prune()
        self.consumed_file.write(json.dumps({"step": s.step, "groups": s.groups, "versions": s.versions}) + "\n")
        self.consumed_file.flush()
        self.progress.update(s.step, metrics.last, s.samples)
        if self.overviews is not None:
            self.overviews.step(s.step, metrics.last, s.staleness)

    def on_checkpoint(self, version: int) -> None:
        self.retention.checkpointed(version)
        if self.overviews is not None:
            self.overviews.checkpoint(version)

    def close(self) -> None:
        """The step records and sinks (the background writer is :meth:`close_background`'s)."""
        self.progress.close()
        self.steps_file.close()
        self.consumed_file.close()
        self.writer.close()
        if self.wandb is not None:
            self.wandb.close()

    def close_background(self) -> None:
        """Every queued dump and checkpoint overview written (the run's work is over)."""
        self.background.close()

    def finish(self, summary: dict[str, Any], model_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        """``summary.json`` and ``orchestrator_state.json``; for a completed run also the Hugging Face
        export of the trained policy and the timeline (a stopped run: the checkpoint is what
        matters, quickly)."""
        from dora_megatron.weights.export import export_final

        run_dir = self.run_dir
        if summary["status"] == "completed":
            try:  # the trained policy for evaluation harnesses; the run's own outputs are written whatever happens here
                final_version, final_dir = export_final(run_dir, model_dir)
            except OSError as err:  # no weights to export (a model-less harness), a full disk, ...
                summary.update(hf_final=None, hf_final_version=None, hf_final_error=f"{type(err).__name__}: {err}")
                say(f"no Hugging Face export of the trained policy: {err} (`dora export` writes one from the snapshots)")
            else:
                summary.update(hf_final=str(final_dir), hf_final_version=final_version)
                say(f"trained policy (version {final_version}) as a Hugging Face directory: {final_dir}")
        write_summary(run_dir, summary)
        (run_dir / "orchestrator_state.json").write_text(json.dumps(self.orch.snapshot()))
        if summary["status"] == "completed" and self.timeline is not None:
            obs = self.cfg.observability
            self.timeline.write_chrome_trace(run_dir / "trace.json")
            try:  # a picture that cannot be drawn is reported; the trace above has every interval
                self.timeline.write_png(run_dir / "timeline.png", title=self.cfg.orchestrator.mode,
                                        window_steps=obs.timeline_window_steps, warmup_steps=obs.warmup_steps)
            except (OSError, ValueError) as err:
                say(f"no timeline.png: {type(err).__name__}: {err}")
        return summary


class SnapshotRetention:
    """Deletes per-version weight snapshots once no live version and no resumable checkpoint needs them.

    The last two checkpoints count: resume falls back to the previous one when the newest is corrupt."""

    KEEP_CHECKPOINTS = 2

    def __init__(self, run_dir: Path, live_versions: Callable[[], Sequence[int]]) -> None:
        self.run_dir = run_dir
        self.live_versions = live_versions  # the orchestrator's live versions, now
        self._floors: list[float] = [0.0]  # oldest live version at each of the last checkpoints

    @property
    def min_live_at_checkpoint(self) -> float:
        return min(self._floors)

    @min_live_at_checkpoint.setter
    def min_live_at_checkpoint(self, value: float) -> None:
        self._floors = [value]

    def checkpointed(self, version: int) -> None:
        self._floors = (self._floors + [min(self.live_versions())])[-self.KEEP_CHECKPOINTS:]

    def prune(self) -> None:
        import shutil

        keep_from = min(min(self.live_versions()), self.min_live_at_checkpoint)
        for path in (self.run_dir / "weights").glob("v*"):
            try:
                version = int(path.name[1:].split(".")[0])
            except ValueError:
                continue
            if 0 < version < keep_from:
                shutil.rmtree(path, ignore_errors=True)


def clock(seconds: float) -> str:
    """``754.2 -> '12:34'`` (minutes:seconds; hours:minutes:seconds from one hour)."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """The progress line of ``dora train``: a tqdm bar on a terminal, else a log line per step with an ETA."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: tqdm[Never] | None = None  # no iterable: a bar updated by hand
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="dora train", unit="step", dynamic_ncols=True)
        self.total = total
        self.t0 = time.monotonic()
        self.done = 0

    def update(self, step: int, scalars: Mapping[str, Any], samples: int = 0) -> None:
        """Step ``step`` of ``samples`` samples ended with ``scalars``; a step whose rewards all
        failed gets a warning of its own (a flat reward of 0 is otherwise all the user sees)."""
        reward = scalars.get("reward/mean")
        errors = scalars.get("reward/errors") or 0
        text = (f"reward={reward:.3f} live_versions={scalars.get('versions/live')} "
                f"tok/s={scalars.get('perf/throughput_tokens_per_s') or 0:.0f}"
                + (f" reward_errors={errors}" if errors else ""))
        if samples and errors >= samples:
            log.warning("step %d: the reward function failed on every sample (%d of %d scored 0; the first "
                        "error's traceback is logged above)", step + 1, errors, samples)
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:  # the tqdm bar shows its own ETA; log lines carry one computed from this run's pace
            eta = (time.monotonic() - self.t0) / self.done * max(self.total - step - 1, 0)
            log.info("step %d/%d %s eta=%s", step + 1, self.total, text, clock(eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
