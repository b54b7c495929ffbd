"""The trainer as a service: torchrun ranks that take commands from the controller. The trainer
job's entry point: ``torchrun ... -m dora_megatron.trainer.service --run-dir R --model M``.

Every rank builds a :class:`~dora_megatron.trainer.worker.TrainerWorker` from the run's resolved
``config.yaml`` and wraps it in :class:`VersionedWorker`, which adds what the runtime needs on top of
the Megatron worker: the integer weight version (DESIGN section 2) and the per-version Hugging Face
snapshot with its checksum (DESIGN section 8). Rank 0 then serves the HTTP API below and the other
ranks follow its commands (:func:`main`).

Why this shape: the controller is an asyncio process that must never block on
training, and the trainer is a torchrun job whose ranks must execute the same
collective calls in the same order. Rank 0 therefore serves a tiny HTTP API on
loopback (stdlib ``http.server``), decodes each command's body once into a typed record
(:class:`Command`) and queues it for its main thread, which
executes them one at a time (the order the ranks execute) and broadcasts each to the other
ranks over the gloo world group; all ranks run it; rank 0 answers. Each request has a thread
of its own, so ``GET /health`` answers during a long step: the controller's watchdog
(``controller.trainer_timeout_s``) tells a busy trainer from a lost one by it. Commands:

``GET /health``            -> {"ready": true, "version": v, "world_size": n}
``POST /train``            {"step": t, "samples": [...]} or {"step": t, "batch": {"dir", "samples"}} (a
                           batch directory, :mod:`dora_megatron.comm.batch_files`: each rank reads only the
                           samples its data-parallel share trains) -> metrics, new version, snapshot path, checksum,
                           train_s and export_s (seconds of the update and of the snapshot export)
``POST /save_checkpoint``  {"path": dir} -> {"path": dir}
``POST /load_checkpoint``  {"path": dir} -> {"version": v}
``POST /push_weights``     {"engines": [base urls], "bucket_mb": n, "master_addr"?, "timeout_s"?,
                           "gpus"? {url: TP size}, "pause_mode"? abort|retract|in_place,
                           "master_port"? (rendezvous store port; default: a free one),
                           "backend"? gloo|nccl (default: nccl on a CUDA trainer, gloo on CPU)} ->
                           bytes, seconds, per-engine versions, checksum of what was sent
                           (:func:`dora_megatron.weights.transport.push_distributed`)
``POST /shutdown``         -> {"ok": true}; every rank exits its loop

Credentials (:mod:`dora_megatron.comm.auth`): with the job's secret, every command needs
``Authorization: Bearer <secret>`` (401 without, 403 with a wrong one, checked before the body is
read); ``/health`` stays open and tells a caller without it only ``{"ready": true}``. Checkpoints are
saved and loaded only under the run directory (403 otherwise, naming the rule).

Every new version is exported once, as a Hugging Face safetensors snapshot
(``<run_dir>/weights/v000001``) that rollout engines load with
``/update_weights_from_disk``; late switchers load the same snapshot.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from queue import Queue
from typing import Annotated, Any, Callable, Protocol, TypeVar

import msgspec
from msgspec import Meta

from dora_megatron.comm import auth
from dora_megatron.comm.batch_files import BatchFileError, BatchReader
from dora_megatron.comm.routed_spool import SPOOL_DIR
from dora_megatron.comm.train_sample import SampleError, TrainRequest, TrainSample, decode_train
from dora_megatron.comm.protocol import PAUSE_MODES, field_message

log = logging.getLogger("dora_megatron.trainer.service")  # the same name when torchrun runs it as __main__


class TrainWorker(Protocol):
    """What the service needs from a trainer rank (``dora_megatron.trainer.worker``)."""

    version: int

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]: ...

    def data_rows(self, lengths: list[int]) -> list[int]: ...

    def export_snapshot(self, out_dir: Path) -> str | None: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def push_weights(self, engines: list[str], bucket_mb: float, master_addr: str, timeout_s: float,
                     gpus: dict[str, int] | None = None, pause_mode: str | None = None,
                     master_port: int | None = None, backend: str | None = None) -> dict[str, Any] | None: ...


class VersionedWorker:
    """The Megatron worker plus version tracking and per-version snapshots: the :class:`TrainWorker`
    of a real job (tests hand the service fakes)."""

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


class BadRequest(ValueError):
    """A malformed command: answered with HTTP 400, the trainer keeps running."""


#: the routes of the service (method, path): the handler serves these and answers 404 to any other
#: (a POST's command is its path without the slash); the route test calls each one
ROUTES = (("GET", "/health"), ("POST", "/train"), ("POST", "/save_checkpoint"), ("POST", "/load_checkpoint"),
          ("POST", "/shutdown"), ("POST", "/push_weights"))
CHECKPOINT_RULE = "the trainer saves and loads checkpoints only under the run directory"
BATCH_RULE = "the trainer reads batch files only under the run directory"


@dataclass
class PushBody:
    """The ``/push_weights`` fields, typed: msgspec checks a body against them (strictly: no bool
    for a number, no string for a port); :meth:`TrainerService.execute` calls the push with them."""

    engines: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]  # base URLs
    bucket_mb: Annotated[float, Meta(gt=0)]
    master_addr: str = "127.0.0.1"  # null is refused (it was never a default)
    backend: str | None = None
    master_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    timeout_s: Annotated[float, Meta(gt=0)] | None = None
    gpus: dict[str, Annotated[int, Meta(ge=1)]] | None = None  # engine URL -> its TP size
    pause_mode: str | None = None


@dataclass
class CheckpointBody:
    """``/save_checkpoint`` and ``/load_checkpoint``: the checkpoint directory (under the run's)."""

    path: str


#: a command's typed body, what every rank executes it from: ``/train``'s request, a checkpoint's
#: path, a push's fields (``/shutdown`` has none)
Body = TrainRequest | CheckpointBody | PushBody | None
_B = TypeVar("_B", TrainRequest, CheckpointBody, PushBody)


@dataclass
class Command:
    """One command, decoded and checked by rank 0's HTTP handler, executed by every rank in the
    order rank 0 queued it. ``op``: the route without its slash; ``body``: the typed body.

    WHY typed: the ranks after rank 0 get it pickled (``torch.distributed.broadcast_object_list``)
    and run it from its fields, so what the handler checked is what each rank runs (no second
    reading of a JSON dict). Under torchrun this module runs as ``__main__`` on every rank, so
    ``Command`` and the bodies defined here pickle as ``__main__.<name>`` and resolve to the same
    classes on every rank; :class:`~dora_megatron.comm.train_sample.TrainRequest` pickles by its
    module path."""

    op: str
    body: Body = None

    def body_as(self, kind: type[_B]) -> _B:
        """The body, a ``kind``; a :class:`BadRequest` when the command carries another."""
        if not isinstance(self.body, kind):
            raise BadRequest(f"command {self.op!r} takes a {kind.__name__} body, got {type(self.body).__name__}")
        return self.body


def validate_checkpoint(payload: dict[str, Any]) -> CheckpointBody:
    """A checkpoint command's body, its ``path`` checked by msgspec (a :class:`BadRequest` naming
    the field and value otherwise)."""
    try:
        return msgspec.convert(payload, CheckpointBody, strict=True)
    except msgspec.ValidationError as err:
        raise BadRequest(field_message(err, payload, what="the checkpoint command")) from None


def validate_push(payload: dict[str, Any]) -> PushBody:
    """``payload`` as a :class:`PushBody`, or a :class:`BadRequest` naming the field and value: the
    types by msgspec, then what they cannot say (known names, the ``gpus`` keys among the
    ``engines``)."""
    try:
        push = msgspec.convert(payload, PushBody, strict=True)
    except msgspec.ValidationError as err:
        raise BadRequest(field_message(err, payload, what="/push_weights")) from None
    if push.backend is not None and push.backend not in ("gloo", "nccl"):
        raise BadRequest(f"'backend' must be gloo or nccl, got {push.backend!r}")
    if push.gpus is not None:
        unknown = sorted(set(push.gpus) - set(push.engines))
        if unknown:
            raise BadRequest(f"'gpus' names engines not in 'engines': {unknown}")
    if push.pause_mode is not None and push.pause_mode not in PAUSE_MODES:
        raise BadRequest(f"'pause_mode' must be one of {list(PAUSE_MODES)} or null, got {push.pause_mode!r}")
    return push


class TrainerService:
    """Executes commands on every rank; rank 0 also owns the HTTP front end."""

    def __init__(self, worker: TrainWorker, run_dir: Path, rank: int, world_size: int,
                 broadcast: Callable[[Any], Any] | None = None, secret: str | None = None) -> None:
        self.worker = worker
        self.run_dir = Path(run_dir)
        self.keys = auth.Keys(secret, secret)  # no secret: a service started outside a job answers anyone
        self.rank = rank
        self.world_size = world_size
        self._broadcast = broadcast or (lambda obj: obj)
        self._inbox: Queue[tuple[Command, Queue]] = Queue()

    # ---- command execution (all ranks) ----------------------------------
    def _samples(self, request: TrainRequest) -> tuple[list[TrainSample], int]:
        """A ``/train`` command's samples on this rank, and the bytes of sample data it read: from
        the body, or from a batch directory, where this rank reads only the rows its data-parallel
        share trains (the worker's own plan of the step, by the lengths in the request)."""
        if request.batch is None:
            if not request.samples:  # decode_train refuses it; a Command built by hand may not
                raise BadRequest("'samples' must be a non-empty list")
            return request.samples, 0
        try:
            reader = BatchReader(request.batch)
        except BatchFileError as err:
            raise BadRequest(str(err)) from None
        samples = reader.samples(self.worker.data_rows(reader.lengths()))
        return samples, reader.bytes_read

    def execute(self, cmd: Command) -> dict[str, Any]:
        if cmd.op == "train":
            request = cmd.body_as(TrainRequest)
            step = request.step
            if step != self.worker.version:
                raise BadRequest(f"step {step} does not match the trainer's weights version {self.worker.version}")
            t0 = time.monotonic()
            samples, read = self._samples(request)
            # the step's bounds in the trainer's log: where a lost trainer was (mid-step or between steps)
            log.info("step %d: training on %d sample(s) (%d bytes read by this rank in %.3f s)", step, len(samples),
                     read, time.monotonic() - t0)
            metrics = self.worker.train_step(samples)
            t1 = time.monotonic()
            snapshot_dir = self.run_dir / "weights" / f"v{self.worker.version:06d}"
            checksum = self.worker.export_snapshot(snapshot_dir)
            log.info("step %d: trained, version %d exported", step, self.worker.version)
            # the two phases, measured here: the controller cannot split one /train call (metrics:
            # perf/train_time_s, and the snapshot export as trainer-side weight sync, perf/sync_time_s)
            return {"version": self.worker.version, "metrics": metrics, "snapshot": str(snapshot_dir), "checksum": checksum,
                    "train_s": t1 - t0, "export_s": time.monotonic() - t1, "batch_bytes_read": read}
        if cmd.op == "save_checkpoint":
            path = cmd.body_as(CheckpointBody).path
            self.worker.save_checkpoint(path)
            return {"path": path, "version": self.worker.version}
        if cmd.op == "load_checkpoint":
            self.worker.load_checkpoint(cmd.body_as(CheckpointBody).path)
            return {"version": self.worker.version}
        if cmd.op == "push_weights":
            push = cmd.body_as(PushBody)
            return self.worker.push_weights(list(push.engines), float(push.bucket_mb),
                                            push.master_addr or "127.0.0.1",  # "" as before: the default
                                            float(push.timeout_s) if push.timeout_s is not None else 120.0,
                                            push.gpus, push.pause_mode, push.master_port, push.backend) or {}
        if cmd.op == "shutdown":
            return {"ok": True}
        raise BadRequest(f"unknown command {cmd.op!r}")

    def follower_loop(self) -> None:
        """Ranks > 0: receive each command from rank 0 and execute it."""
        while True:
            cmd = self._broadcast(None)
            try:
                self.execute(cmd)
            except Exception:  # rank 0 reports the error; keep the collective order
                log.exception("rank %d: command %s failed", self.rank, cmd.op)
            if cmd.op == "shutdown":
                return

    def leader_loop(self, host: str, port: int, ready_file: Path | None = None) -> None:
        """Rank 0: serve HTTP in a thread, execute queued commands here (main thread)."""
        server = ThreadingHTTPServer((host, port), _make_handler(self))
        thread = threading.Thread(target=server.serve_forever, name="trainer-http", daemon=True)
        thread.start()
        bound = server.server_address[1]
        log.info("trainer service on http://%s:%d (world size %d)", host, bound, self.world_size)
        if ready_file is not None:
            ready_file.write_text(json.dumps({"port": bound}))
        try:
            while True:
                cmd, reply = self._inbox.get()
                self._broadcast(cmd)
                try:
                    reply.put((200, self.execute(cmd)))
                except BadRequest as err:
                    reply.put((400, {"error": str(err)}))
                except Exception as err:  # noqa: BLE001 - reported to the controller, process stays up
                    log.exception("command %s failed", cmd.op)
                    reply.put((500, {"error": f"{type(err).__name__}: {err}"}))
                if cmd.op == "shutdown":
                    return
        finally:
            server.shutdown()

    def submit(self, cmd: Command) -> tuple[int, dict[str, Any]]:
        reply: Queue = Queue(maxsize=1)
        self._inbox.put((cmd, reply))
        return reply.get()


def _make_handler(service: TrainerService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
            log.debug("http: " + fmt, *args)

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            """Answer 401/403 (and nothing else happens) unless the caller holds the job's secret."""
            status = service.keys.decide(self.path, True, self.headers.get("Authorization"))
            if status is not None:
                self._send(status, {"error": auth.DENIED[status]})
            return status is not None

        def do_GET(self) -> None:
            if self.path == "/health":
                body: dict[str, Any] = {"ready": True}
                if service.keys.decide("/", True, self.headers.get("Authorization")) is None:
                    body.update(version=service.worker.version, world_size=service.world_size)
                self._send(200, body)
            elif not self._refused():
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:
            if self._refused():
                return
            op = self.path[1:] if ("POST", self.path) in ROUTES else None
            if op is None:
                self._send(404, {"error": f"unknown path {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(payload, dict):
                    raise BadRequest("body must be a JSON object")
                body: Body = None  # /shutdown
                if op == "train":
                    body = decode_train(payload)  # the samples or the batch entry: typed and checked
                    entry = body.batch
                    if entry is not None:  # before any file is opened: the directory is the run's
                        auth.inside(entry.dir, [service.run_dir], BATCH_RULE)
                        if any(s.routed_at is not None for s in entry.samples):
                            # spooled routed experts are read beside it (comm.routed_spool): in the run too
                            auth.inside(Path(entry.dir).parent / SPOOL_DIR, [service.run_dir], BATCH_RULE)
                        BatchReader(entry)  # the files are there and match: else a 400 naming the field
                elif op in ("save_checkpoint", "load_checkpoint"):
                    body = validate_checkpoint(payload)
                    auth.inside(body.path, [service.run_dir], CHECKPOINT_RULE)
                elif op == "push_weights":
                    body = validate_push(payload)
            except json.JSONDecodeError as err:
                self._send(400, {"error": f"malformed JSON: {err.msg}"})
                return
            except (BadRequest, BatchFileError, SampleError) as err:
                self._send(400, {"error": str(err)})
                return
            except auth.OutsideJob as err:
                self._send(403, {"error": str(err)})
                return
            code, answer = service.submit(Command(op, body))
            self._send(code, answer)

    return Handler


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

    from dora_megatron.config.schema import load_config
    from dora_megatron.ports import job_port_range
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
