"""Every shipped config loads; the schema's cross-section rules; the configuration reference is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import DoraConfig, load_config

ROOT = Path(__file__).resolve().parents[3]
JOB_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sim" not in p.relative_to(ROOT / "configs").parts)


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_job_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, DoraConfig)


def test_cpu_tiny_is_the_main_job():
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml")
    assert cfg.orchestrator.mode == "dora" and 1 <= cfg.orchestrator.max_staleness <= 2
    assert cfg.model.preset == "tiny-moe" and cfg.rollout.engine == "embedded"


def test_defaults_load():
    assert load_config(None) == DoraConfig()


def test_misspelled_key_names_it_and_suggests(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("orchestrator:\n  max_stalenes: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert err.value.path == "orchestrator.max_stalenes"
    assert "did you mean 'max_staleness'" in str(err.value)


@pytest.mark.parametrize("override,where", [
    ("orchestrator.rbs=2", "orchestrator.rbs"),            # rbs < tbs (default tbs 8)
    ("orchestrator.max_staleness=-1", "orchestrator.max_staleness"),
    ("orchestrator.mode=async", "orchestrator.mode"),
    ("rollout.num_instances=0", "rollout.num_instances"),
    ("rollout.temperature=hot", "rollout.temperature"),
    ("trainer.tp=2", "launch.trainer_procs"),               # 1 process cannot hold tp=2
    ("data.max_len=0", "data.max_len"),
    ("run.steps=0", "run.steps"),
    ("observability.log_level=LOUD", "observability.log_level"),
    ("launch.backend=k8s", "launch.backend"),
    ("model.preset=huge", "model.preset"),
    ("algo.clip_eps_low=-1", "algo.clip_eps_low"),
])
def test_invalid_values_name_the_field(override, where):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.path == where, str(err.value)


def test_layout_rule_accepts_a_fitting_layout():
    cfg = load_config(None, ["trainer.tp=2", "launch.trainer_procs=2"])
    assert cfg.trainer.tp == 2


def test_overrides_apply_and_resolve(tmp_path):
    from dora_megatron.config.loader import dump_yaml

    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", ["orchestrator.max_staleness=1", "run.steps=3"])
    assert cfg.orchestrator.max_staleness == 1 and cfg.run.steps == 3
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_yaml(cfg))
    assert load_config(again) == cfg


def test_configuration_reference_is_current():
    from dora_megatron.config.docs import END, REFERENCE_FILE, START, render_reference

    text = (ROOT / REFERENCE_FILE).read_text()
    block = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert block == render_reference().strip(), f"{REFERENCE_FILE} is stale: run python tools/gen_config_docs.py"


def test_write_reference_rewrites_only_the_block_between_the_markers(tmp_path):
    """``write_reference`` (what tools/gen_config_docs.py runs) replaces a stale block, keeps the text
    around it, and reports no change when the block is current."""
    from dora_megatron.config.docs import END, START, render_reference, write_reference

    doc = tmp_path / "configuration.md"
    doc.write_text(f"# intro\n\n{START}\nstale table\n{END}\n\ntail text\n")
    assert write_reference(doc) is True
    text = doc.read_text()
    assert text.startswith("# intro\n\n") and text.endswith("\n\ntail text\n") and "stale table" not in text
    assert text.split(START, 1)[1].split(END, 1)[0].strip() == render_reference().strip()
    assert write_reference(doc) is False
    (tmp_path / "plain.md").write_text("no markers here\n")
    with pytest.raises(ValueError, match="config-reference markers"):
        write_reference(tmp_path / "plain.md")


@pytest.mark.parametrize("override,where,says", [
    ("trainer.checkpoint_dir=/ck", "trainer.checkpoint_dir", "run.checkpoint_interval"),
    ("trainer.checkpoint_interval=5", "trainer.checkpoint_interval", "run.checkpoint_interval"),
    ("sglang.skip_tokenizer_init=false", "sglang.skip_tokenizer_init", "always starts SGLang with --skip-tokenizer-init"),
    ("algo.kl_coef=0.1", "algo.kl_coef", "no reference model"),
])
def test_keys_that_did_nothing_are_refused_naming_what_to_use(override, where, says):
    """Issue A1: every config key acts or is gone. These were never read (or failed at step 1)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.path == where and says in str(err.value), str(err.value)


def test_resolved_config_of_an_older_run_still_loads(tmp_path):
    """``--resume`` reads the run's resolved config.yaml, which lists every key: one written before
    the removals holds the removed keys at their old (inert) defaults, and must still load."""
    from dora_megatron.config.loader import dump_yaml, read_yaml

    resolved = dump_yaml(load_config(ROOT / "configs" / "cpu_tiny.yaml"))
    old = resolved.replace("trainer:\n", "trainer:\n  checkpoint_dir: ''\n  checkpoint_interval: 0\n", 1)
    old = old.replace("sglang:\n", "sglang:\n  skip_tokenizer_init: true\n", 1)
    assert old.count("skip_tokenizer_init") == 1 and old.count("checkpoint_dir") == 1
    path = tmp_path / "config.yaml"
    path.write_text(old)
    assert read_yaml(path)["trainer"]["checkpoint_dir"] == ""
    assert load_config(path) == load_config(ROOT / "configs" / "cpu_tiny.yaml")


def test_routing_replay_on_the_vllm_engine_is_refused():
    """The vLLM adapter returns no routed experts: replay there would train without replaying."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine=vllm", "algo.routing_replay=true"])
    assert err.value.path == "algo.routing_replay" and "vllm" in str(err.value)
    load_config(None, ["rollout.engine=vllm"])  # without replay the same engine is accepted


def test_resolved_config_written_by_an_earlier_release_still_loads():
    """A real ``config.yaml`` of a run made before today's removals (written by that code, not built
    here): ``dora train --resume`` of such a run must load it, whichever keys were removed since.
    Keys added since keep their default there (token-budget micro-batches came after it)."""
    old = Path(__file__).parent / "data" / "cpu_tiny_resolved_cd25a72.yaml"
    # data.answer_key's default became verl's reward_model.ground_truth after it (the old file spells "answer");
    # rollout.spec_token_cost (cpu_tiny's measured CPU figure) came later too; the cluster's fixed
    # ports were its defaults then (0 = a free port picked on the node now): the file keeps them
    assert load_config(old) == load_config(ROOT / "configs" / "cpu_tiny.yaml",
                                            ["trainer.max_tokens_per_micro_batch=0", "data.answer_key=answer",
                                             "rollout.spec_token_cost=0.25", "cluster.torchrun_port=29500",
                                             "cluster.trainer_service_port=29600", "cluster.weight_group_port=29700",
                                             "cluster.rollout_base_port=30000"])


def test_gen_config_docs_help_prints_help_and_check_writes_nothing(tmp_path):
    """tools/gen_config_docs.py in a copy of the tree whose reference is stale: ``--help`` prints
    the usage and ``--check`` exits 1, neither touches the file; a plain run rewrites it, after
    which ``--check`` exits 0."""
    import os
    import shutil
    import subprocess
    import sys

    from dora_megatron.config.docs import END, REFERENCE_FILE, START

    (tmp_path / "tools").mkdir()
    tool = tmp_path / "tools" / "gen_config_docs.py"
    shutil.copy(ROOT / "tools" / "gen_config_docs.py", tool)
    doc = tmp_path / REFERENCE_FILE
    doc.parent.mkdir(parents=True)
    stale = f"# intro\n\n{START}\nstale table\n{END}\n"
    doc.write_text(stale)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args):
        return subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, env=env, timeout=120)

    helped = run("--help")
    assert helped.returncode == 0 and "usage: tools/gen_config_docs.py" in helped.stdout and "--check" in helped.stdout
    assert doc.read_text() == stale
    checked = run("--check")
    assert checked.returncode == 1 and "stale" in checked.stderr and doc.read_text() == stale
    assert run("--no-such-flag").returncode == 2 and doc.read_text() == stale
    assert run().returncode == 0 and "stale table" not in doc.read_text()
    assert run("--check").returncode == 0
