"""``build_controller(config, endpoints, ...)``: the controller of a run, built from the typed config.

WHY here and not in a launcher: the local launcher, the SLURM node launcher and the load harness
(tools/controller_scale.py) run the same controller against engines and a trainer they started
in different ways. Launchers start processes and pass :class:`Endpoints`; what the controller is
made of (engine and trainer clients, prompts and reward, the orchestrator, restored from a
checkpoint or new, the journal, the event queue, the runtime) is decided once, here; each of the
runtime's components is handed the config sections it reads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.records import RunPaths, instance_slots
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.observability.summary import StepRecord

if TYPE_CHECKING:
    from dora_megatron.controller.journal import Journal
    from dora_megatron.controller.records import Engine, LoadReports
    from dora_megatron.observability.recorder import MetricsRecorder
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.controller.trainer_client import TrainerClient
    from dora_megatron.data.codec import TextCodec
    from dora_megatron.data.reward_api import RewardScorer
    from dora_megatron.data.tasks import PromptSource
    from dora_megatron.observability.background import BackgroundWriter
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.orchestrator import Orchestrator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Where the processes a launcher started answer: instance name -> engine base URL, and the
    trainer's URL."""

    engines: dict[str, str]
    trainer: str


def push_options(cfg: DoraConfig, trainer_url: str) -> PushOptions:
    """The fields of every ``distributed`` broadcast of the run (``controller.weight_transport``),
    derived from several sections: the bucket size (``controller``), where engines reach the
    trainer's rendezvous (its URL's host; the fixed port of ``cluster`` under SLURM), and on SGLang
    the group's backend, ranks per engine and pause mode (``sglang``)."""
    sglang = cfg.rollout.engine == "sglang"
    return PushOptions(
        bucket_mb=cfg.controller.bucket_mb, master_addr=urlsplit(trainer_url).hostname,
        master_port=(cfg.cluster.weight_group_port or None) if cfg.launch.backend == "slurm" else None,
        backend=cfg.sglang.weight_group_backend if sglang else None,
        engine_ranks=cfg.sglang.tp_size if sglang else 1, pause_mode=cfg.sglang.pause_mode if sglang else None)


def prompt_source(cfg: DoraConfig, codec: TextCodec) -> tuple[PromptSource, RewardScorer, str]:
    """``data``: the prompts (rendered by ``codec`` when a dataset is checked at load), the reward
    scorer (:class:`~dora_megatron.data.reward_api.RewardScorer`; its worker processes start here)
    and the reward in words."""
    from dora_megatron.data.sources import make_scorer
    from dora_megatron.data.sources import prompt_source as data_prompt_source

    source = data_prompt_source(cfg, codec)
    scorer, name = make_scorer(cfg.data)
    return source, scorer, name


@dataclass
class Controller:
    """A built controller: :func:`~dora_megatron.controller.main.drive` runs it;
    :meth:`close` releases its journal and reward workers."""

    runtime: Runtime
    trainer: TrainerClient
    engines: dict[str, Engine]
    reward_name: str
    scorer: RewardScorer | None = None  # its worker processes end with close
    source: PromptSource | None = None  # the prompts (data_skipped_rows)
    state: dict[str, Any] | None = None  # the checkpoint's controller.json it resumed from
    journal: Journal | None = None
    restorable_samples: int = 0  # finished samples the journal may restore (resume)

    @property
    def orch(self) -> Orchestrator:
        return self.runtime.orch

    def close(self) -> None:
        """Release the journal and the reward's worker processes."""
        if self.journal is not None:
            self.journal.close()
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()


def build_controller(cfg: DoraConfig, endpoints: Endpoints, *, run_dir: Path, model_dir: Path,
                     make_engine: Callable[[str], Engine], checkpoint: Path | None = None,
                     on_step: Callable[[StepRecord, MetricsRecorder], None] | None = None,
                     on_checkpoint: Callable[[int], None] | None = None, timeline: Timeline | None = None,
                     metric_sinks: Sequence[Any] = (), load_reports: LoadReports | None = None,
                     background: BackgroundWriter | None = None,
                     eval_sinks: Sequence[Any] | None = None) -> Controller:
    """Clients for ``endpoints``, prompts, the orchestrator (restored from ``checkpoint`` when
    given, with its journal), and the runtime that executes its actions.

    ``make_engine(url)``: the launcher's engine-client factory (local runs hand it the processes
    it may restart). ``on_step(step_log, metrics)`` after each trained step, ``on_checkpoint(version)``
    at each checkpoint's cut, in its loop turn (the launcher's snapshot retention reads the live versions then).
    ``metric_sinks``: where the metrics recorder writes each step's scalars (TensorBoard, steps.jsonl).
    ``load_reports``: pushed load reports replacing the stats polls of the engines they cover
    (``rollout.client_workers``, :class:`~dora_megatron.rollout.sharded.ClientPool`).
    ``background``: the launcher's :class:`~dora_megatron.observability.background.BackgroundWriter`;
    the rollout dumps are written on it, off the event loop (the launcher closes it).
    ``eval_sinks``: where the eval set's rounds write ``eval/...`` (default ``metric_sinks``; a
    launcher leaves out the per-step file)."""
    from dora_megatron.controller.loop import EventQueue
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.controller.trainer_client import TrainerClient
    from dora_megatron.data.sources import job_codec
    from dora_megatron.observability.recorder import MetricsRecorder
    from dora_megatron.orchestrator import Orchestrator

    engines = {name: make_engine(url) for name, url in endpoints.engines.items()}
    trainer = TrainerClient(endpoints.trainer, batch_dir=run_dir / "batches")
    codec = job_codec(cfg, model_dir)
    source, scorer, reward_name = prompt_source(cfg, codec)
    from dora_megatron.data.sources import eval_prompts

    evals = eval_prompts(cfg, codec)  # checked whole at load, like the training prompts
    state_file = checkpoint / "controller.json" if checkpoint is not None else None
    state = json.loads(state_file.read_text()) if state_file is not None else None
    if state is not None:
        from dora_megatron.controller.controller_state import check_format

        try:  # before anything reads it: a file (or an orchestrator snapshot) an older dora wrote, by name
            check_format(state)
            orch = Orchestrator.restore(cfg.orchestrator, state["orchestrator"])
        except ValueError as err:
            raise ValueError(f"{state_file}: {err}") from err
    else:
        orch = Orchestrator(cfg.orchestrator, list(endpoints.engines))
    journal = None
    if cfg.controller.journal and cfg.run.checkpoint_interval > 0:
        from dora_megatron.controller.journal import Journal

        journal = Journal(run_dir)
    slots = instance_slots(cfg.rollout.max_running, cfg.orchestrator.cap_before_rebalance)
    metrics = MetricsRecorder(slots_per_instance=slots, rebalancer=orch.policy.rebalance,
                              warmup_steps=cfg.observability.warmup_steps, sinks=metric_sinks)
    rollout_dump = None
    if cfg.observability.dump_rollouts > 0:
        from dora_megatron.observability.rollout_dump import RolloutDumper

        rollout_dump = RolloutDumper(run_dir, cfg.observability.dump_rollouts, codec, writer=background)
    workflow = None
    if cfg.rollout.workflow:
        from dora_megatron.workflow.runner import workflow_runner

        workflow = workflow_runner(cfg.rollout.workflow, cfg.rollout.workflow_kwargs, codec,
                                   cfg.data.chat_template_kwargs, cfg.trainer.max_seq_len)
    # each component reads its own section of the loaded config (the objects themselves)
    runtime = Runtime(orch, engines, trainer, source, scorer.score_sync, run=cfg.run,
                      paths=RunPaths(run_dir, model_dir), rollout=cfg.rollout, controller=cfg.controller,
                      observability=cfg.observability, algo=cfg.algo, push=push_options(cfg, endpoints.trainer),
                      timeline=timeline,
                      on_step=on_step, on_checkpoint=on_checkpoint, codec=codec, journal=journal, metrics=metrics,
                      load_reports=load_reports, rollout_dump=rollout_dump, workflow=workflow, events=EventQueue())
    if evals is not None:
        from dora_megatron.controller.evaluation import Evaluator

        # after the runtime: the eval rounds load their final weights through its weight sync
        runtime.attach_evaluator(Evaluator(
            evals, scorer, engines=engines, pool=runtime.pool, weights=runtime.weights, codec=codec,
            observability=cfg.observability, rollout=cfg.rollout, seed=cfg.run.seed, slots=slots,
            sinks=metric_sinks if eval_sinks is None else eval_sinks, out=run_dir / "eval.jsonl",
            path=cfg.data.eval_path))
    restorable = 0
    if state is not None:
        from dora_megatron.observability.recorder import read_step_rows

        # the recorder's rows of the steps done are steps.jsonl's (the launcher has cut the crashed
        # lineage's lines after the checkpoint); controller.json keeps only their count
        try:
            runtime.controller_state.load_state_dict(state, read_step_rows(run_dir / "steps.jsonl",
                                                                           int(state["steps_done"])))
        except ValueError as err:  # an entry this version cannot read: which file, then which entry and key
            raise ValueError(f"{state_file}: {err}") from err
    if journal is not None:
        if state is not None and runtime.workflow is None:  # what the crashed lineage finished after this
            # checkpoint (a workflow's samples are not journaled: they run again), then start anew
            from dora_megatron.controller.journal import read_journal

            samples = read_journal(run_dir, int(state["version"]))
            runtime.replay.load(samples)
            restorable = len(samples)
        journal.start(int(state["version"]) if state is not None else None)
    spool = runtime.store.routed_spool
    if state is not None and spool is not None:  # every sample naming the spool is held again: the rest goes
        spool.resumed()
    return Controller(runtime, trainer, engines, reward_name, scorer, source, state, journal, restorable)
