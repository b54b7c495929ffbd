"""The SGLang tier: dora's SGLang path against real SGLang 0.5.23 servers on CPU.

Opt-in (marker ``sglang``, ``DORA_SGLANG=1``): needs the venv of ``tools/setup_sglang_cpu.sh``
(``DORA_SGLANG_PYTHON`` or the default ``sglang.python`` of ``configs/cpu_sglang.yaml``). Without
``DORA_SGLANG=1``, or without the venv, every test here is skipped with that reason, except a
missing venv in CI (``CI=true``) with ``DORA_SGLANG=1``, which is a failure.

The scenarios of ``tests/integration/test_sglang_path.py`` (written against the stand-in) run here
unchanged against real servers: the same test functions, with this module's ``engines`` fixture
(three real one-thread CPU servers) in place of the stand-ins. Beside them: ``dora train`` on
``configs/cpu_sglang.yaml`` end to end with both weight transports (disk snapshots; ``distributed``
over a gloo group); and what real CPU SGLang cannot do, each pinned by a test that fails once it
works: routed experts (R3) and NGRAM speculative decoding (docs/sglang.md, "SGLang on CPU").
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.sglang_real import require_sglang, start_real_sglang
from tests.helpers.train_job import run_train
from tests.integration import test_sglang_path as path_tests

pytestmark = [pytest.mark.integration, pytest.mark.sglang]


@pytest.fixture(scope="module", autouse=True)
def sglang_venv():
    """Opt-in (``DORA_SGLANG=1``): the tier takes minutes and needs the SGLang venv."""
    return require_sglang()


model_dir = path_tests.model_dir  # the same random tiny MoE with long-tailed greedy answers


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """Three real SGLang servers (the stand-ins' places), started in parallel; stopped by pid."""
    logs = tmp_path_factory.mktemp("sglang-logs")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_real_sglang, model_dir, logs, name=f"sgl{i}", weight_version="0")
                   for i in range(3)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 3:
            raise RuntimeError(f"SGLang start failed: {[f.exception() for f in futures if f.exception()]}")
        print("start to ready, s:", [round(e.ready_s, 1) for e in started])
        yield started
    finally:
        for e in started:
            e.stop()


# ---------------------------------------------------------------- the stand-in's scenarios, real
# The stand-in's migration scenario (a resubmitted greedy continuation equals the uninterrupted
# sequence token for token) is not run here: on real 0.5.23 in float32 the re-prefill's logits differ
# from decoding's in the last bits, and at a near-tie the continuation leaves the sequence (seen in
# the clean-clone CI re-run of 2026-12-06: EOS after 16 tokens uninterrupted, another token after the
# move). The tier's train jobs move requests by resubmit on real servers and check nothing is lost.
# The push scenario runs its whole choreography (abort, then retract pause over gloo) and fails at one
# assertion, where 0.5.23 differs from the stand-in: a push naming a tensor the model lacks
# ("experts.99") is accepted, where the stand-in refuses before receiving ("DID NOT RAISE PushError");
# strict: once it passes, drop the mark.
@pytest.mark.xfail(raises=pytest.fail.Exception, strict=True, reason="real SGLang 0.5.23 accepts a distributed "
                   "update naming a tensor the model lacks (the stand-in refuses it)")
def test_distributed_push_abort_and_retract_on_real_sglang(engines, model_dir, tmp_path):
    path_tests.test_distributed_push_choreography_against_sglang_0_5_23(engines, model_dir, tmp_path)


# ---------------------------------------------------------------- NGRAM speculative decoding
def test_ngram_speculation_needs_sgl_kernel_ops_that_no_cpu_wheel_provides(model_dir, tmp_path):
    """``sglang.speculative_algorithm: NGRAM`` does not start on this CPU venv: SGLang 0.5.23's NGRAM
    worker imports ``sgl_kernel.speculative`` (``kernels/ops/speculative/reconstruct_tree.py``) and
    builds its draft tree with ``sgl_kernel`` ops (``spec_tree.py``), compiled code that no CPU wheel
    of ``sglang-kernel`` on PyPI provides. If this starts failing, NGRAM runs on CPU: turn this into
    an equality test with a plain server."""
    with pytest.raises(RuntimeError) as died:
        start_real_sglang(model_dir, tmp_path, name="sgl-ngram", timeout_s=400,
                          overrides=("sglang.speculative_algorithm=NGRAM",))
    text = str(died.value)
    assert "ngram_worker" in text and "No module named 'sgl_kernel.speculative'" in text, text[-3000:]


# ---------------------------------------------------------------- routed experts (R3)
def test_routed_experts_cannot_start_on_cpu_and_the_config_says_so_first(model_dir, tmp_path):
    """``--enable-return-routed-experts`` on a CPU server: SGLang 0.5.23 dies at start, registering
    its routed-experts host buffer with CUDA (``state_capturer/base.py`` -> ``_cuda_host_register``).
    So dora refuses routing replay / router agreement with SGLang on CPU before starting anything.
    If this starts failing, the capturer runs on CPU: drop the config check and compare the routing
    with the trainer's (``algo.router_agreement``) here."""
    from dora_megatron.config.base import ConfigError
    from tests.helpers.sglang_real import cpu_config

    with pytest.raises(RuntimeError) as died:
        start_real_sglang(model_dir, tmp_path, name="sgl-routed", routed_experts=True, timeout_s=400)
    text = str(died.value)
    assert "Torch not compiled with CUDA enabled" in text and "routed_experts" in text, text[-3000:]
    with pytest.raises(ConfigError, match="cannot start on CPU"):
        cpu_config(["algo.router_agreement=true"])


# ---------------------------------------------------------------- dora train end to end
#: the tier's `dora train` runs: fewer prompts per step than the shipped config, short answers
QUICK = ("orchestrator.tbs=4", "orchestrator.rbs=8", "orchestrator.group_size=8", "rollout.max_new_tokens=48",
         "data.max_len=12", "observability.tensorboard=false", "observability.timeline=false")


def check_job(proc, run_dir, steps: int, tbs: int) -> tuple[dict, list[dict]]:
    """A whole job: every group consumed exactly once, none lost, C1 = C3 = 0 from the real
    servers' echoed per-request weight versions; returns the summary and the step records."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["consumed_groups"] == steps * tbs
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    assert summary["failed_instances"] == [], summary["failed_instances"]
    consumed = [g for line in (run_dir / "consumed.jsonl").read_text().splitlines() for g in json.loads(line)["groups"]]
    assert len(consumed) == len(set(consumed)) == steps * tbs
    assert summary["migrations_kv"] == 0  # SGLang has no KV export: resubmit only
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    for i in range(2):  # both instances were started by the launcher and served
        log = (run_dir / "logs" / f"engine{i}.log").read_text(errors="replace")
        assert "POST /generate HTTP" in log, log[-2000:]
    # the job's secret (SGLang's keys, from its --config) is in no file but its own two 0600 ones: the
    # servers logged their resolved arguments, keys redacted
    from dora_megatron.comm import auth

    secret = (run_dir / auth.SECRET_FILE).read_text().strip().encode()
    kept = {run_dir / auth.SECRET_FILE, run_dir / auth.SGLANG_KEYS_FILE}
    assert "<redacted>" in (run_dir / "logs" / "engine0.log").read_text(errors="replace")
    assert not [p for p in run_dir.rglob("*") if p.is_file() and p not in kept and secret in p.read_bytes()]
    return summary, rows


@pytest.mark.timeout(900)
def test_dora_train_moe_on_sglang_with_disk_snapshots(tmp_path):
    """The main job's task on two real SGLang instances started by dora's launcher: versions reach
    them as disk snapshots (``/update_weights_from_disk``); in float32 (the config's ``--dtype``)
    SGLang's log-probs are the fp32 trainer's. The reward is printed, not asserted: over 24 steps
    it did not rise measurably (0.80 -> 0.80 by halves on 2026-12-06, lists of <= 8 digits)."""
    steps = 24
    proc, run_dir = run_train(tmp_path, f"run.steps={steps}", "model.warm_start_steps=150", "trainer.lr=2e-4",
                              *QUICK, "data.max_len=8", config="cpu_sglang.yaml", timeout=840)
    summary, rows = check_job(proc, run_dir, steps, 4)
    rewards = [r["reward/mean"] for r in rows]
    print({"rewards": rewards,
           **{k: summary[k] for k in ("wall_time_s", "throughput_tokens_per_s", "max_live_versions", "migrations",
                                      "migrations_reprefill", "rollout_vs_trainer_logprob_diff_max")}})
    assert summary["rollout_vs_trainer_logprob_diff_steps"] >= 1
    assert summary["rollout_vs_trainer_logprob_diff_max"] < 1e-5, summary["rollout_vs_trainer_logprob_diff_max"]
    assert summary["max_live_versions"] >= 2
    log = (run_dir / "logs" / "engine0.log").read_text(errors="replace")
    assert "POST /update_weights_from_disk HTTP/1.1\" 200" in log, log[-2000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pause_mode", ["in_place"])
def test_dora_train_moe_on_sglang_over_a_gloo_weight_group(tmp_path, pause_mode):
    """``controller.weight_transport: distributed``: the trainer broadcasts each version to both
    real instances over a gloo group (0.5.23's ``init_weights_update_group`` with
    ``backend: gloo``), pausing them with ``sglang.pause_mode``."""
    steps = 4
    proc, run_dir = run_train(tmp_path, f"run.steps={steps}", "model.warm_start_steps=10",
                              "controller.weight_transport=distributed", f"sglang.pause_mode={pause_mode}",
                              *QUICK, config="cpu_sglang.yaml", timeout=840)
    summary, _ = check_job(proc, run_dir, steps, 4)
    print({k: summary[k] for k in ("wall_time_s", "weight_push_bytes", "checksum_mismatches", "max_live_versions")})
    assert summary["weight_push_bytes"] > 0 and summary["checksum_mismatches"] == 0
    for i in range(2):  # each real instance took versions over the group, paused around each push
        log = (run_dir / "logs" / f"engine{i}.log").read_text(errors="replace")
        assert "POST /init_weights_update_group HTTP/1.1\" 200" in log, log[-2000:]
        assert "POST /update_weights_from_distributed HTTP/1.1\" 200" in log, log[-2000:]
        assert "POST /pause_generation HTTP/1.1\" 200" in log and "POST /continue_generation HTTP/1.1\" 200" in log
