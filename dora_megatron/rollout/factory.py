"""``engine_for``: the runtime's client of one rollout instance, chosen by ``rollout.engine``.

WHY in rollout and not in a launcher: local runs, SLURM nodes, elastic joins, the capacity probe of
``dora bench`` and the client worker processes of ``rollout.client_workers`` all build the same
client, and the worker processes live in rollout (which must not import the launchers).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora_megatron.comm.answer_reader import AnswerReader
    from dora_megatron.comm.limits import ConnectionPlan, ConnectionWaits
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.processes import ProcessSet


def engine_for(cfg: "DoraConfig", url: str, model_dir: str, procs: "ProcessSet | None" = None,
               run_dir: Path | None = None, *, plan: "ConnectionPlan | None" = None,
               waits: "ConnectionWaits | None" = None, reader: "AnswerReader | None" = None):
    """The runtime's client of the instance at ``url``, by ``rollout.engine`` (local runs, SLURM and
    elastic joins alike). ``procs``: the launcher's processes, when it may restart vLLM instances;
    ``run_dir``: the run's (shared) directory, through which other nodes restart theirs.
    ``plan`` / ``waits``: this process's connection budget and back-pressure count
    (:mod:`dora_megatron.comm.limits`; SGLang and embedded clients); ``reader``: this process's
    receive budget and decoder thread for their big answers (:class:`~dora_megatron.comm.answer_reader.AnswerReader`)."""
    if cfg.rollout.engine == "sglang":  # SGLang protocol only: abort+resubmit migration, echoed-version C1 check
        from dora_megatron.comm.sglang_client import SGLangClient
        from dora_megatron.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(SGLangClient(url, timeout_s=cfg.rollout.request_timeout_s, plan=plan, waits=waits,
                                         reader=reader),
                            checksum=not cfg.sglang.enable_eplb)  # EPLB: per-instance expert layouts
    if cfg.rollout.engine == "vllm":  # vLLM API: resubmit migration, weight_versions C1 guard, reload/restart switch
        from dora_megatron.rollout.vllm.launch import make_vllm_engine

        return make_vllm_engine(cfg, url, model_dir, procs, run_dir)
    from dora_megatron.comm.engine_client import EngineClient

    return EngineClient(url, timeout_s=cfg.rollout.request_timeout_s, plan=plan, waits=waits, reader=reader)
