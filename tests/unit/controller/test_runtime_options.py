"""The runtime's options come from the config, and each default is owned once, by the config.

WHY: ``RuntimeOptions`` once restated 24 config values with literals of their own, so a test or
tool that built options by hand ran with other defaults than ``dora train``, and a config key the
builder forgot fell silently back to that literal (issue A3 item 2). Here: the hand-built defaults
equal what ``dora train`` builds from the default config, and every key the runtime reads changes
the option the runtime's components read when it changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.controller.build import runtime_options
from dora_megatron.controller.records import RuntimeOptions
from dora_megatron.controller.trainer_client import PushOptions

TRAINER = "http://10.1.2.3:8100"

# config overrides -> the options they must give, written out (not derived from the builder). An
# entry with several overrides sets what makes its key act (the SGLang push fields exist on SGLang).
KEYS: list[tuple[tuple[str, ...], str, object]] = [
    (("run.steps=7",), "steps", 7),
    (("run.seed=5",), "seed", 5),
    (("rollout.max_new_tokens=17",), "max_new_tokens", 17),
    (("rollout.temperature=0.5",), "temperature", 0.5),
    (("rollout.top_p=0.25",), "top_p", 0.25),
    (("rollout.top_k=5",), "top_k", 5),
    (("observability.stats_interval_s=2.5",), "stats_interval_s", 2.5),
    (("rollout.max_running=3",), "slots_per_instance", 3),
    (("orchestrator.cap_before_rebalance=6",), "slots_per_instance", 6),
    (("rollout.request_timeout_s=12",), "request_timeout_s", 12.0),
    (("controller.health_timeout_s=11",), "health_timeout_s", 11.0),
    (("controller.verify_checksums=false",), "verify_checksums", False),
    (("controller.migration=reprefill",), "migration", "reprefill"),
    (("controller.weight_transport=distributed",), "weight_transport", "distributed"),
    (("controller.bucket_mb=64",), "push.bucket_mb", 64.0),
    (("launch.backend=slurm", "cluster.weight_group_port=29123"), "push.master_port", 29123),
    (("rollout.engine=sglang", "sglang.weight_group_backend=gloo"), "push.backend", "gloo"),
    (("rollout.engine=sglang", "sglang.tp_size=2"), "push.engine_ranks", 2),
    (("rollout.engine=sglang", "sglang.pause_mode=retract"), "push.pause_mode", "retract"),
    (("rollout.stop_token_ids=[3, 4]",), "stop_token_ids", (3, 4)),
    (("controller.weight_sync_timeout_s=42",), "weight_sync_timeout_s", 42.0),
    (("run.checkpoint_interval=2",), "checkpoint_interval", 2),
    (("controller.stop_checkpoint_timeout_s=9",), "stop_checkpoint_timeout_s", 9.0),
    (("algo.routing_replay=true",), "routed_experts", True),
    (("algo.router_agreement=true",), "routed_experts", True),
    (("rollout.speculative=group",), "draft_siblings", True),
    (("rollout.spec_max_batch=3",), "draft_push_max_batch", 3),
]

# not config values: the run's directories (paths of the run, tested by the launcher's tests), the
# trainer's host (from the launcher's endpoints) and a constant of the stats poll
NOT_KEYS = {"snapshot_dir", "checkpoint_dir", "stats_concurrency", "push.master_addr"}


def _options(tmp_path: Path, *overrides: str) -> RuntimeOptions:
    return runtime_options(load_config(None, overrides), tmp_path / "run", tmp_path / "model", TRAINER)


def _get(opts: RuntimeOptions, name: str) -> object:
    value: object = opts
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _names() -> set[str]:
    names = {f.name for f in dataclasses.fields(RuntimeOptions) if f.name != "push"}
    return names | {f"push.{f.name}" for f in dataclasses.fields(PushOptions)}


def test_hand_built_defaults_are_the_default_configs(tmp_path):
    built = _options(tmp_path)
    by_hand = RuntimeOptions(steps=built.steps, seed=built.seed, max_new_tokens=built.max_new_tokens,
                             temperature=built.temperature, top_p=built.top_p, top_k=built.top_k,
                             snapshot_dir=built.snapshot_dir, checkpoint_dir=built.checkpoint_dir)
    differ = {name: (_get(by_hand, name), _get(built, name)) for name in _names() - NOT_KEYS
              if _get(by_hand, name) != _get(built, name)}
    assert not differ, f"defaults that are not the config's (by hand, from the config): {differ}"


@pytest.mark.parametrize("overrides,name,expected", KEYS, ids=[" ".join(k[0]) for k in KEYS])
def test_each_key_reaches_the_runtime(tmp_path, overrides, name, expected):
    base = _options(tmp_path, *overrides[:-1])
    changed = _options(tmp_path, *overrides)
    assert _get(base, name) != expected, f"{name} is already {expected!r} without {overrides[-1]}"
    assert _get(changed, name) == expected
    untouched = {n for n in _names() - NOT_KEYS - {name} if _get(base, n) != _get(changed, n)}
    assert not untouched, f"{overrides[-1]} also changed {untouched}"


def test_every_option_has_a_key():
    """A new option either reads a config key (and joins KEYS) or says why not (NOT_KEYS)."""
    assert _names() - NOT_KEYS == {name for _, name, _ in KEYS}
