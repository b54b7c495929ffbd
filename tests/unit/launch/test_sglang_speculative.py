"""Speculative decoding on the real engines: the SGLang flags dora emits exist in SGLang 0.5.23's
argument definitions (read from the wheel's source), and bad ``sglang.speculative_*`` /
``vllm.speculative_*`` values are refused naming their key."""

from __future__ import annotations

import json

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.config.sglang import SPECULATIVE_ALGORITHMS
from dora_megatron.rollout.sglang.args import InstanceSpec, SGLangArgsError, server_argv
from dora_megatron.rollout.vllm.server import server_argv as vllm_argv
from tests import sglang_wheel

SGL = ["rollout.engine=sglang", "rollout.device=cuda"]
#: configs whose argv together emit every flag dora_flags can emit
EMITTING = {
    "eagle": ["sglang.speculative_algorithm=EAGLE", "sglang.speculative_draft_model_path=/draft",
              "sglang.speculative_num_steps=3", "sglang.speculative_eagle_topk=4",
              "sglang.speculative_num_draft_tokens=8", "sglang.load_format=dummy", "sglang.tp_size=4",
              "sglang.ep_size=4", "sglang.enable_eplb=true", "sglang.ep_num_redundant_experts=4",
              "sglang.attn_dp_size=4", "sglang.moe_a2a_backend=flashinfer", "sglang.mem_fraction_static=0.7",
              "sglang.context_length=4096", "sglang.disable_radix_cache=true"],
    "nextn": ["sglang.speculative_algorithm=NEXTN", "sglang.load_format=dummy"],
    "ngram": ["sglang.speculative_algorithm=NGRAM", "sglang.speculative_num_draft_tokens=16",
              "sglang.speculative_ngram_match_type=PROB", "sglang.speculative_ngram_max_bfs_breadth=4",
              "sglang.speculative_ngram_capacity=1000"],
    # configs/cpu_sglang.yaml's CPU flags (with NGRAM, which the SGLang tier runs on CPU)
    "cpu": ["rollout.device=cpu", "sglang.attention_backend=torch_native", "sglang.cuda_graph=false",
            "sglang.disable_overlap_schedule=true", "sglang.max_total_tokens=4096", "sglang.sleep_on_idle=true",
            "sglang.speculative_algorithm=NGRAM"],
}


def _argv(overrides: list[str], **inst) -> list[str]:
    cfg = load_config(None, SGL + overrides)
    spec = InstanceSpec(**{"name": "s0", "model_path": "/m", "host": "0.0.0.0", "port": 30000, "nccl_port": 30001,
                           "base_gpu_id": 0, "tp_size": cfg.sglang.tp_size, **inst})
    return list(server_argv(spec, cfg.sglang, cfg.rollout, routed_experts=True))[3:]


@pytest.fixture(scope="module")
def wheel():
    root = sglang_wheel.wheel_root()
    if root is None:
        pytest.skip("SGLang 0.5.23's wheel is missing: run tools/setup_env.sh")
    assert sglang_wheel.wheel_version(root) == sglang_wheel.WHEEL_VERSION
    return root


@pytest.mark.parametrize("name", sorted(EMITTING))
def test_every_emitted_flag_and_value_is_one_sglang_0_5_23_defines(wheel, name):
    flags = sglang_wheel.server_flags(wheel)
    inst = {"nnodes": 2, "node_rank": 1, "dist_init_addr": "h:1"} if name == "eagle" else {}
    argv = _argv(EMITTING[name], **inst)
    seen, i = [], 0
    while i < len(argv):
        flag = argv[i]
        assert flag in flags, f"{flag} is not a flag of SGLang 0.5.23 (arg_groups/fields)"
        seen.append(flag)
        if flags[flag].switch:
            i += 1
            continue
        value = argv[i + 1]
        choices = flags[flag].choices
        assert choices is None or value in choices, f"{flag} {value}: 0.5.23 accepts {choices}"
        i += 2
    assert "--speculative-algorithm" in seen


def test_our_choices_are_sglang_0_5_23_s(wheel):
    known = sglang_wheel.speculative_algorithms(wheel)
    assert set(SPECULATIVE_ALGORITHMS) - {"none"} <= known, known
    flags = sglang_wheel.server_flags(wheel)
    assert flags["--speculative-ngram-match-type"].choices == ("BFS", "PROB")
    assert flags["--speculative-draft-load-format"].choices is not None and \
        "auto" in flags["--speculative-draft-load-format"].choices


def test_speculative_flags_cannot_bypass_the_section():
    with pytest.raises(SGLangArgsError, match="sglang.speculative_"):
        _argv(["rollout.sglang_args=[--speculative-algorithm=EAGLE3]"])


def test_a_separate_draft_is_loaded_from_its_checkpoint_when_the_target_starts_dummy():
    f = _argv(EMITTING["eagle"])
    assert f[f.index("--speculative-draft-load-format") + 1] == "auto"
    assert f[f.index("--speculative-draft-model-path") + 1] == "/draft"
    plain = _argv(["sglang.speculative_algorithm=EAGLE", "sglang.speculative_draft_model_path=/draft"])
    assert "--speculative-draft-load-format" not in plain  # the draft follows --load-format auto
    assert "--speculative-num-steps" not in plain  # unset: SGLang chooses steps, topk and draft tokens together
    ngram = _argv(EMITTING["ngram"] + ["sglang.load_format=dummy"])
    assert "--speculative-draft-load-format" not in ngram and "--speculative-draft-model-path" not in ngram
    assert ngram[ngram.index("--speculative-ngram-max-bfs-breadth") + 1] == "4"
    assert not any(x.startswith("--speculative") for x in _argv([]))


@pytest.mark.parametrize("override,where,why", [
    (["sglang.speculative_algorithm=EAGLE"], "sglang.speculative_draft_model_path", "draft model"),
    (["sglang.speculative_algorithm=EAGLE3", "sglang.speculative_draft_model_path=/d"],
     "sglang.speculative_algorithm", "llama_eagle3"),
    (["sglang.speculative_num_steps=3"], "sglang.speculative_num_steps", "none"),
    (["sglang.speculative_ngram_capacity=5"], "sglang.speculative_ngram_capacity", "none"),
    (["sglang.speculative_algorithm=NEXTN", "sglang.speculative_ngram_match_type=PROB"],
     "sglang.speculative_ngram_match_type", "NGRAM"),
    (["sglang.speculative_algorithm=NGRAM", "sglang.speculative_draft_model_path=/d"],
     "sglang.speculative_draft_model_path", "no draft model"),
    (["sglang.speculative_algorithm=NGRAM", "sglang.speculative_eagle_topk=2"], "sglang.speculative_eagle_topk",
     "max_bfs_breadth"),
    (["sglang.speculative_algorithm=NGRAM", "sglang.speculative_ngram_min_bfs_breadth=5",
      "sglang.speculative_ngram_max_bfs_breadth=2"], "sglang.speculative_ngram_min_bfs_breadth", "exceeds"),
    (["sglang.speculative_algorithm=NGRAM", "sglang.tp_size=2", "sglang.attn_dp_size=2"], "sglang.attn_dp_size",
     "attention DP"),
    (["sglang.speculative_algorithm=NEXTN", "sglang.speculative_eagle_topk=2"], "sglang.speculative_num_steps",
     "together"),
    (["sglang.speculative_algorithm=NEXTN", "sglang.speculative_num_steps=2"], "sglang.speculative_eagle_topk",
     "together"),
    (["sglang.speculative_algorithm=NEXTN", "sglang.speculative_num_steps=3", "sglang.speculative_eagle_topk=1",
      "sglang.speculative_num_draft_tokens=6"], "sglang.speculative_num_draft_tokens", "num_steps + 1"),
    (["sglang.speculative_algorithm=MEDUSA"], "sglang.speculative_algorithm", ""),
])
def test_bad_sglang_speculative_settings_name_the_key(override, where, why):
    with pytest.raises(ConfigError) as err:
        load_config(None, SGL + override)
    assert err.value.path == where and why in str(err.value)


def test_vllm_speculative_config_is_json_with_vllm_s_key_names():
    cfg = load_config(None, ["rollout.engine=vllm", "vllm.speculative_method=ngram", "vllm.speculative_num_tokens=4",
                             "vllm.speculative_prompt_lookup_max=3", "vllm.speculative_prompt_lookup_min=2"])
    argv = list(vllm_argv("/m", "127.0.0.1", 1, cfg.vllm, cfg.rollout))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    plain = load_config(None, ["rollout.engine=vllm"])
    assert "--speculative-config" not in vllm_argv("/m", "127.0.0.1", 1, plain.vllm, plain.rollout)


@pytest.mark.parametrize("override,where", [
    (["vllm.speculative_num_tokens=4"], "vllm.speculative_num_tokens"),
    (["vllm.speculative_method=ngram", "vllm.speculative_prompt_lookup_min=4", "vllm.speculative_prompt_lookup_max=2"],
     "vllm.speculative_prompt_lookup_min"),
    (["vllm.speculative_method=eagle"], "vllm.speculative_method"),
    (['vllm.extra_args=["--speculative-config", "{}"]'], "vllm.extra_args"),
])
def test_bad_vllm_speculative_settings_name_the_key(override, where):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine=vllm", *override])
    assert err.value.path == where


def test_an_eagle_draft_that_would_take_the_targets_tensors_is_refused_before_start(tmp_path):
    from dora_megatron.rollout.sglang.launch import local_sglang_engines

    def engines(arch: str):
        draft = tmp_path / arch
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps({"architectures": [arch]}))
        cfg = load_config(None, SGL + ["sglang.speculative_algorithm=EAGLE", f"sglang.speculative_draft_model_path={draft}"])
        return local_sglang_engines(cfg, "/m", 30000)

    argv = engines("LlamaForCausalLMEagle")[0].argv
    assert "--speculative-algorithm" in argv
    with pytest.raises(SGLangArgsError, match="LlamaForCausalLMEagle3"):
        engines("LlamaForCausalLMEagle3")
