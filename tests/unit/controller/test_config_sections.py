"""Each controller component reads its own section of the loaded config, and each config key the
controller reads reaches the component that acts on it, and nothing else.

WHY: a ``RuntimeOptions`` bag once restated 24 config values (first with literals of its own, then
with the sections' defaults), filled by a builder that copied them one by one: a key the builder
forgot fell silently back to a default, and a test or tool that built the bag by hand could run
with other values than ``dora train`` (issue A3). Now ``build_controller`` hands each component
the sections themselves. Here, through that builder: every key changes what the component that
reads it sees and nothing another component reads; every component holds the loaded config's own
section objects (no copy); and every config read in the components' code has a key below.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dora_megatron.config.schema import DoraConfig, load_config
from dora_megatron.controller.main import Endpoints, build_controller
from dora_megatron.controller.records import RunPaths
from dora_megatron.controller.runtime import Runtime
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.data.tokenizer import save_tokenizer

CONTROLLER = Path(__file__).resolve().parents[3] / "dora_megatron" / "controller"
TRAINER = "http://10.1.2.3:8100"

# config overrides -> the component's reading they must change, and its value, written out (not
# derived from the builder). An entry with several overrides sets what makes its key act (the
# SGLang push fields exist on SGLang; the cap after the first rebalance must stay below the one before).
KEYS: list[tuple[tuple[str, ...], str, object]] = [
    (("run.steps=7",), "training.run.steps", 7),
    (("run.seed=5",), "store.seed", 5),
    (("run.checkpoint_interval=2",), "training.run.checkpoint_interval", 2),
    (("rollout.max_new_tokens=17",), "store.rollout.max_new_tokens", 17),
    (("rollout.temperature=0.5",), "store.rollout.temperature", 0.5),
    (("rollout.top_p=0.25",), "store.rollout.top_p", 0.25),
    (("rollout.top_k=5",), "store.rollout.top_k", 5),
    (("rollout.stop_token_ids=[3, 4]",), "store.rollout.stop_token_ids", [3, 4]),
    (("rollout.request_timeout_s=12",), "generation.rollout.request_timeout_s", 12.0),
    (("rollout.speculative=group",), "generation.rollout.draft_siblings", True),
    (("rollout.spec_max_batch=3",), "generation.rollout.spec_max_batch", 3),
    (("algo.routing_replay=true",), "generation.algo.wants_routed_experts", True),
    (("algo.router_agreement=true",), "generation.algo.wants_routed_experts", True),
    (("rollout.max_running=3",), "metrics.slots_per_instance", 3),
    (("orchestrator.cap_after_rebalance=4", "orchestrator.cap_before_rebalance=6"), "metrics.slots_per_instance", 6),
    (("observability.stats_interval_s=2.5",), "stats.observability.stats_interval_s", 2.5),
    (("controller.health_timeout_s=11",), "stats.controller.health_timeout_s", 11.0),
    (("controller.migration=reprefill",), "moves.controller.migration", "reprefill"),
    (("controller.verify_checksums=false",), "weights.controller.verify_checksums", False),
    (("controller.weight_transport=distributed",), "weights.controller.weight_transport", "distributed"),
    (("controller.weight_sync_timeout_s=42",), "weights.controller.weight_sync_timeout_s", 42.0),
    (("controller.stop_checkpoint_timeout_s=9",), "training.controller.stop_checkpoint_timeout_s", 9.0),
    (("controller.bucket_mb=64",), "weights.push.bucket_mb", 64.0),
    (("launch.backend=slurm", "cluster.weight_group_port=29123"), "weights.push.master_port", 29123),
    (("rollout.engine=sglang", "sglang.weight_group_backend=gloo"), "weights.push.backend", "gloo"),
    (("rollout.engine=sglang", "sglang.tp_size=2"), "weights.push.engine_ranks", 2),
    (("rollout.engine=sglang", "sglang.pause_mode=retract"), "weights.push.pause_mode", "retract"),
]
READINGS = sorted({name for _, name, _ in KEYS})

# not config keys: the trainer's host (from the launcher's endpoints; checked below) and the run's
# directories (the launcher's, :class:`RunPaths`)
NOT_KEYS = {"push.master_addr"}

# each component's attribute that holds a config section (or a value derived from sections), by
# the section: what the scan of the components' code below resolves ``self.<attr>.<field>`` with
SECTION_ATTRS = {"run", "rollout", "controller", "observability", "algo", "push"}


def _build(tmp_path: Path, *overrides: str) -> tuple[DoraConfig, Runtime]:
    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir(parents=True, exist_ok=True)
    if not model_dir.exists():
        model_dir.mkdir()
        save_tokenizer(model_dir)
    cfg = load_config(None, overrides)
    ctl = build_controller(cfg, Endpoints({"a": "http://127.0.0.1:1"}, TRAINER), run_dir=run_dir,
                           model_dir=model_dir, make_engine=lambda url: url)
    ctl.close()
    return cfg, ctl.runtime


def _get(rt: Runtime, name: str) -> object:
    value: object = rt
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _readings(rt: Runtime) -> dict[str, object]:
    return {name: _get(rt, name) for name in READINGS}


@pytest.mark.parametrize("overrides,name,expected", KEYS, ids=[" ".join(k[0]) for k in KEYS])
def test_each_key_reaches_the_component_that_reads_it(tmp_path, overrides, name, expected):
    _, base = _build(tmp_path, *overrides[:-1])
    _, changed = _build(tmp_path, *overrides)
    assert _get(base, name) != expected, f"{name} is already {expected!r} without {overrides[-1]}"
    assert _get(changed, name) == expected
    before, after = _readings(base), _readings(changed)
    untouched = {n for n in READINGS if n != name and before[n] != after[n]}
    assert not untouched, f"{overrides[-1]} also changed {untouched}"


def test_each_component_holds_the_loaded_configs_own_sections(tmp_path):
    """The sections themselves, not copies: what a component reads is the config the job loaded."""
    cfg, rt = _build(tmp_path)
    held = {"store.rollout": cfg.rollout, "generation.rollout": cfg.rollout, "generation.algo": cfg.algo,
            "stats.observability": cfg.observability, "stats.controller": cfg.controller,
            "moves.controller": cfg.controller, "weights.controller": cfg.controller,
            "training.run": cfg.run, "training.controller": cfg.controller}
    assert {name: _get(rt, name) is section for name, section in held.items()} == dict.fromkeys(held, True)
    assert rt.store.seed == cfg.run.seed
    paths = RunPaths(tmp_path / "run", tmp_path / "model")
    assert rt.weights.paths == rt.training.paths == rt.checkpoints.paths == paths
    assert rt.weights.push.master_addr == "10.1.2.3"  # where engines reach the trainer: its URL's host


def test_every_config_read_of_a_component_has_a_key():
    """A new config read in a component either joins KEYS or fails here: the scan finds every
    ``self.<section>.<field>`` in the controller's modules (the ``push`` record is read whole by
    its ``request``: each of its fields instead)."""
    read: set[str] = set()
    for path in CONTROLLER.glob("*.py"):
        for attr, field in re.findall(r"\bself\.(\w+)\.(\w+)", path.read_text()):
            if attr in SECTION_ATTRS and not (attr == "push" and field == "request"):
                read.add(f"{attr}.{field}")
    read |= {f"push.{f.name}" for f in dataclasses.fields(PushOptions)}
    # the readings of a section's field (not the derived store.seed and metrics.slots_per_instance)
    keyed = {".".join(name.split(".")[-2:]) for name in READINGS if name.split(".")[-2] in SECTION_ATTRS}
    assert read - NOT_KEYS == keyed, (f"read without a key: {sorted(read - NOT_KEYS - keyed)}; "
                                      f"keyed but not read: {sorted(keyed - read)}")
