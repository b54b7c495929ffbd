"""Rollout dumps (``observability.dump_rollouts: N``): what the model was sent and what it answered.

WHY: metrics say a reward went up or down; only the samples say why (a prompt rendered without its
system turn, a response cut at ``max_new_tokens``, a reward function that never matches). Each step,
N of the samples the trainer is handed are written to ``RUN_DIR/rollouts/step_XXXXXX.jsonl``, one
JSON object per sample::

    {"step", "sample_id", "group_id", "version", "finish_reason", "reward",
     "prompt_text", "prompt_ids", "response_text", "response_ids"}

``prompt_text`` is the prompt ids decoded with special tokens kept (the chat template's markers
visible: exactly what the engine was sent); ``response_text`` is the response decoded with special
tokens skipped (what the reward function was given). The rows are taken where the controller hands
the batch to the trainer, so they are the trained samples, each step once.

Which samples (:func:`select_samples`): one sample of each group in batch order, then a second of
each, and so on: N samples cover as many prompts as they can. The choice depends on the batch only.

Each file is written whole to a temporary name and renamed (atomic on one file system): a kill
leaves every earlier step's file complete and never a torn one. A step re-done after ``--resume``
replaces its file with the samples of the new lineage.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

ROLLOUTS_DIR = "rollouts"


def select_samples(samples: Sequence[Mapping[str, Any]], n: int) -> list[Mapping[str, Any]]:
    """``n`` of ``samples`` (each with a ``group_id``), round-robin over the groups in order of first
    appearance: the first sample of every group, then the second of every group, ...; all of them
    when ``n`` is at least their number; none for ``n <= 0``."""
    if n <= 0:
        return []
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for s in samples:
        groups.setdefault(s["group_id"], []).append(s)
    out: list[Mapping[str, Any]] = []
    depth = 0
    while len(out) < n:
        layer = [members[depth] for members in groups.values() if depth < len(members)]
        if not layer:
            break
        out += layer[: n - len(out)]
        depth += 1
    return out


def dump_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{int(step):06d}.jsonl"


def dump_row(step: int, sample: Mapping[str, Any], codec: Any) -> dict[str, Any]:
    """One line of a dump: ``sample`` (``prompt_ids``, ``response_ids``, ``reward``, ``version``,
    ``group_id``, optional ``sample_id`` / ``finish_reason``) with its texts through ``codec``
    (:class:`~dora_megatron.data.codec.TextCodec`)."""
    prompt_ids = [int(i) for i in sample["prompt_ids"]]
    response_ids = [int(i) for i in sample["response_ids"]]
    reward = sample.get("reward")
    return {
        "step": int(step), "sample_id": sample.get("sample_id"), "group_id": sample["group_id"],
        "version": int(sample["version"]), "finish_reason": sample.get("finish_reason"),
        "reward": None if reward is None else float(reward),
        "prompt_text": codec.decode_rendered(prompt_ids), "prompt_ids": prompt_ids,
        "response_text": codec.decode(response_ids), "response_ids": response_ids,
    }


def write_atomic_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as JSON lines at ``path``, written to ``path.tmp`` first and renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RolloutDumper:
    """Writes ``n`` samples of each step under ``run_dir/rollouts`` (``n >= 1``; the controller builds
    none when ``observability.dump_rollouts`` is 0).

    ``writer`` (a :class:`~dora_megatron.observability.background.BackgroundWriter`): the decoding
    and the fsynced write run on its thread, off the controller's event loop; the launcher closes
    it at the end of the run, which writes every step still queued. Without one, :meth:`dump`
    writes at once (tools, tests)."""

    def __init__(self, run_dir: str | Path, n: int, codec: Any, writer: Any = None) -> None:
        if int(n) < 1:
            raise ValueError(f"observability.dump_rollouts: {n} samples per step; a dumper needs at least 1")
        self.run_dir = Path(run_dir)
        self.n = int(n)
        self.codec = codec
        self.writer = writer
        self.files = 0  # step files written
        self.failures = 0  # step files that could not be written

    def dump(self, step: int, samples: Sequence[Mapping[str, Any]]) -> Path | None:
        """Write step ``step``'s file from the batch ``samples`` (on the writer's thread when there is
        one: the samples must not change afterwards, the controller's consumed records do not);
        returns its path, or None when it could not be written or queued. A file that cannot be
        written (disk full) is logged and skipped: a dump is for reading, the run goes on."""
        chosen = select_samples(samples, self.n)
        path = dump_path(self.run_dir, step)
        if self.writer is not None:
            return path if self.writer.submit(f"rollout dump {path.name}", self._write, step, chosen, path) else None
        return path if self._write(step, chosen, path) else None

    def _write(self, step: int, chosen: Sequence[Mapping[str, Any]], path: Path) -> bool:
        rows = [dump_row(step, s, self.codec) for s in chosen]
        try:
            write_atomic_jsonl(path, rows)
        except OSError as err:
            self.failures += 1
            log.warning("observability.dump_rollouts: could not write %s (%s); the run goes on", path, err)
            return False
        self.files += 1
        return True
