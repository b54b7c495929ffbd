"""torchrun entry point of the trainer job: ``python -m dora_megatron.trainer.entry``.

Every rank builds a :class:`~dora_megatron.trainer.worker.TrainerWorker` from the
run's resolved ``config.yaml``; rank 0 then serves the
:class:`~dora_megatron.trainer.service.TrainerService` HTTP API and the other
ranks follow its commands. :class:`VersionedWorker` adds what the runtime needs
on top of the Megatron worker: the integer weight version (DESIGN section 2)
and the per-version Hugging Face snapshot with its checksum (DESIGN section 8).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dora_megatron.comm.train_sample import TrainSample

log = logging.getLogger("dora_megatron.trainer")


class VersionedWorker:
    """The Megatron worker plus version tracking and per-version snapshots."""

    def __init__(self, worker: Any, model_dir: str, rank: int, port_range: tuple[int, int] | None = None) -> None:
        self.worker = worker
        self.model_dir = Path(model_dir)
        self.rank = rank
        self.version = 0
        self.port_range = port_range  # launch.port_range: where a push without a fixed store port picks one

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        metrics = self.worker.train_step(samples, current_version=self.version)
        self.version += 1
        return {k: float(v) for k, v in metrics.items()}

    def data_rows(self, lengths: list[int]) -> list[int]:
        """The samples of a step this rank trains (what it reads of a batch directory)."""
        return self.worker.data_rows(lengths)

    def export_snapshot(self, out_dir: Path) -> str | None:
        """Gather HF weights to rank 0 and write ``out_dir`` (config + safetensors); returns the checksum."""
        from dora_megatron.weights.snapshots import write_snapshot

        tensors = {name: t.detach().cpu().clone() for name, t in self.worker.export_hf_state_dict()}
        if self.rank != 0:
            return None
        # atomic (tmp dir + rename): a snapshot directory is complete or absent
        return write_snapshot(out_dir, tensors, self.model_dir, version=self.version)

    def push_weights(self, engines: list[str], bucket_mb: float, master_addr: str = "127.0.0.1",
                     timeout_s: float = 120.0, gpus: dict[str, int] | None = None,
                     pause_mode: str | None = None, master_port: int | None = None,
                     backend: str | None = None) -> dict[str, Any] | None:
        """Collective export, then rank 0 broadcasts the weights to ``engines`` in buckets
        (:func:`dora_megatron.weights.transport.push_distributed`); returns its stats on rank 0.
        ``backend`` None: nccl when this trainer runs on CUDA, gloo otherwise."""
        from dora_megatron.weights.transport import push_distributed

        tensors = list(self.worker.export_hf_state_dict())
        if self.rank != 0:
            return None
        on_cuda = getattr(getattr(self.worker, "cfg", None), "device", "cpu") == "cuda"
        if backend == "nccl" and not on_cuda:
            raise ValueError("backend nccl needs a trainer on CUDA; this one runs on CPU (use gloo)")
        backend = backend or ("nccl" if on_cuda else "gloo")
        result = push_distributed(tensors, engines, bucket_mb, self.version, master_addr, backend, timeout_s=timeout_s,
                                  gpus=gpus, pause_mode=pause_mode, master_port=master_port, port_range=self.port_range)
        return result.to_json()

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)
        if self.rank == 0:
            (Path(path) / "dora_version.json").write_text(json.dumps({"version": self.version}))

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)
        meta = Path(path) / "dora_version.json"
        self.version = int(json.loads(meta.read_text())["version"]) if meta.is_file() else int(self.worker.step)


def main(argv: list[str] | None = None) -> int:
    from dora_megatron.processes import end_with_parent

    end_with_parent()  # torchrun put this rank in a session of its own: it ends with torchrun, its children with it
    parser = argparse.ArgumentParser(description="dora trainer rank (started by torchrun)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--model", required=True, help="HF model directory with the initial weights (version 0)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--resume", default="", help="dist_checkpointing directory to load before serving")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from dora_megatron.comm import auth
    from dora_megatron.config.schema import load_config
    from dora_megatron.ports import job_port_range
    from dora_megatron.trainer.service import TrainerService
    from dora_megatron.trainer.worker import TrainerWorker

    run_dir = Path(args.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    logging.basicConfig(level=getattr(logging, cfg.observability.log_level), format="%(asctime)s %(levelname)s trainer: %(message)s")
    torch.set_num_threads(cfg.launch.trainer_threads)
    megatron_worker = TrainerWorker(cfg.trainer, cfg.algo, args.model, total_steps=cfg.run.steps)
    if cfg.rollout.temperature > 0:  # greedy rollouts report plain log_softmax
        megatron_worker.logit_temperature = cfg.rollout.temperature
    worker = VersionedWorker(megatron_worker, args.model, rank=dist.get_rank(),
                             port_range=job_port_range(cfg.launch.port_range))
    if args.resume:
        worker.load_checkpoint(args.resume)
        log.info("resumed from %s at version %d", args.resume, worker.version)
    rank, world = dist.get_rank(), dist.get_world_size()

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    service = TrainerService(worker, run_dir, rank, world, broadcast=broadcast if world > 1 else None,
                             secret=auth.secret_from_env())
    try:
        if rank == 0:
            service.leader_loop(args.host, args.port, ready_file=run_dir / "trainer.ready")
        else:
            service.follower_loop()
    finally:
        worker.worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    # a ``multiprocessing`` spawn child of a rank (Megatron's checkpoint writers) imports this module
    # under that name before it runs its target: tie it to the rank that started it
    import os

    from dora_megatron.processes import PARENT_PID_ENV, end_with_parent

    end_with_parent(parent=int(os.environ[PARENT_PID_ENV]) if PARENT_PID_ENV in os.environ else None)
