"""Weights & Biases as one more sink of a run's step scalars (``observability.wandb: true``).

Why a sink: every metric of a run already flows through the recorder's sinks (TensorBoard,
``steps.jsonl``); W&B gets the same scalars at the same steps, nothing computed twice. ``wandb`` is an
optional extra (``pip install -e '.[wandb]'``), imported only when the key is on.

Mode: ``WANDB_MODE`` when set; otherwise online only when this machine has W&B credentials
(``WANDB_API_KEY`` or an ``api.wandb.ai`` entry in ``~/.netrc``), else offline, so a cluster node
without network (or without a login) still records the run under ``RUN_DIR/wandb`` for a later
``wandb sync``. Nothing here probes the network.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping


def wandb_mode(env: Mapping[str, str] | None = None, netrc: str | Path | None = None) -> str:
    """``online`` / ``offline`` / ``disabled``: ``WANDB_MODE``, else online with credentials, else offline."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    path = Path(netrc) if netrc is not None else Path.home() / ".netrc"
    try:
        return "online" if "api.wandb.ai" in path.read_text() else "offline"
    except OSError:
        return "offline"


class WandbWriter:
    """A :class:`~dora_megatron.observability.tensorboard.ScalarWriter` logging to a W&B run in
    ``RUN_DIR/wandb``. The run's id is the run directory's name, so ``--resume`` continues the same
    W&B run (steps a resume re-does are logged again only where W&B accepts them: after its last step)."""

    def __init__(self, run_dir: str | Path, project: str, config: Mapping[str, Any] | None = None,
                 mode: str | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("observability.wandb: true needs the wandb package: pip install -e '.[wandb]'") from err
        run_dir = Path(run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.mode = mode or wandb_mode()
        self._run = wandb.init(project=project, name=run_dir.name, id=_run_id(run_dir.name), resume="allow",
                               dir=str(run_dir), config=dict(config or {}), mode=self.mode)

    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        self._run.log({k: float(v) for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() returns before W&B's service has written everything (offline: the run's log file);
        # teardown waits for it. The run is the launcher's only one and this is the run's end.
        wandb.teardown()


def _run_id(name: str) -> str:
    """A W&B run id from the run directory's name (W&B ids: letters, digits, ``-`` and ``_``)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[-64:]
