"""The four modes of DESIGN section 3 as flags of one state machine.

WHY flags, not subclasses: every mode shares the window, admission and batch rules; they differ
only in how much is dispatched at once, when instances change version and what happens to
in-flight work at a weight update. Tests then compare modes on the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.orchestrator import OrchestratorConfig


@dataclass(frozen=True, slots=True)
class ModePolicy:
    """How one mode drives the shared state machine."""

    name: str
    max_staleness: int     # S actually enforced
    rbs: int               # outstanding-group cap actually enforced
    batch_dispatch: bool   # dispatch a whole batch at once, only when nothing is outstanding and
                           # every instance holds the newest version (sync, one_step_off)
    interrupt: bool        # at a weight update, interrupt everything and resubmit (partial)
    rebalance: bool        # multi-version rebalancer (dora with repartition=True); otherwise
                           # drained instances follow the newest version
    caps: bool             # per-instance concurrency caps gate new work (streaming modes)

    @staticmethod
    def from_config(cfg: OrchestratorConfig) -> "ModePolicy":
        mode = cfg.mode
        return ModePolicy(
            name=mode,
            max_staleness=cfg.effective_staleness,
            rbs=cfg.effective_rbs,
            batch_dispatch=mode in ("sync", "one_step_off"),
            interrupt=mode == "partial",
            rebalance=mode == "dora" and cfg.repartition,
            caps=mode in ("partial", "dora"),
        )
