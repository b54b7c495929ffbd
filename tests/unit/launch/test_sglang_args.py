"""SGLang command lines, the weight-push plan (ranks, buckets, flush flags) and the adapter's wire rids."""

from __future__ import annotations

import itertools

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.rollout.sglang.args import InstanceSpec, SGLangArgsError, server_argv
from dora_megatron.comm.sglang_client import summarize_loads
from dora_megatron.rollout.sglang.engine import wire_rid
from dora_megatron.weights.distributed import bucket_flags, group_layout


def _inst(**kw):
    base = dict(name="s0", model_path="/m", host="0.0.0.0", port=30000, nccl_port=30001, base_gpu_id=4, tp_size=4)
    return InstanceSpec(**{**base, **kw})


def _flags(argv):
    """flag -> value (None for switches)."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                out[argv[i]] = nxt
                i += 2
                continue
            out[argv[i]] = None
        i += 1
    return out


def test_argv_has_shape_eplb_and_memory_flags():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "sglang.tp_size=4", "sglang.ep_size=4",
                             "sglang.enable_eplb=true", "sglang.ep_num_redundant_experts=8",
                             "sglang.mem_fraction_static=0.75", "sglang.python=/opt/sgl/bin/python"])
    argv = server_argv(_inst(weight_version="3"), cfg.sglang, cfg.rollout)
    assert argv[:3] == ("/opt/sgl/bin/python", "-m", "sglang.launch_server")
    f = _flags(list(argv[3:]))
    assert f["--tp-size"] == "4" and f["--ep-size"] == "4" and f["--base-gpu-id"] == "4"
    assert "--enable-eplb" in f and f["--ep-num-redundant-experts"] == "8" and f["--eplb-algorithm"] == "auto"
    assert f["--mem-fraction-static"] == "0.75" and f["--weight-version"] == "3"
    assert "--skip-tokenizer-init" in f and f["--port"] == "30000" and f["--nccl-port"] == "30001"
    assert "--enable-ep-moe" not in f and "--nnodes" not in f  # removed in 0.5.x; single node


def test_multi_node_instance_flags_and_user_flag_clash():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "sglang.tp_size=16",
                             "rollout.sglang_args=[--disable-cuda-graph]"])
    f = _flags(list(server_argv(_inst(tp_size=16, nnodes=2, node_rank=1, dist_init_addr="h1:30002"), cfg.sglang, cfg.rollout)))
    assert (f["--nnodes"], f["--node-rank"], f["--dist-init-addr"]) == ("2", "1", "h1:30002")
    assert "--disable-cuda-graph" in f
    with pytest.raises(SGLangArgsError, match="dist_init_addr"):
        server_argv(_inst(tp_size=16, nnodes=2), cfg.sglang, cfg.rollout)
    clash = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "rollout.sglang_args=[--tp-size=2]"])
    with pytest.raises(SGLangArgsError, match="--tp-size"):
        server_argv(_inst(tp_size=1), clash.sglang, clash.rollout)


@pytest.mark.parametrize("override,where", [
    (["sglang.tp_size=4", "sglang.ep_size=3"], "sglang.ep_size"),
    (["sglang.enable_eplb=true"], "sglang.enable_eplb"),
    (["sglang.skip_tokenizer_init=false"], "sglang.skip_tokenizer_init"),
    (["sglang.pause_mode=stop"], "sglang.pause_mode"),
    (["cluster.torchrun_port=29500", "cluster.weight_group_port=29500"], "cluster.weight_group_port"),
])
def test_bad_sglang_and_cluster_settings_name_the_field(override, where):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert err.value.path == where


def test_group_layout_gives_each_instance_consecutive_ranks():
    lay = group_layout({"a": 4, "b": 1, "c": 8})
    assert lay.rank_offsets == (1, 5, 6) and lay.world_size == 14
    ranks = [0] + [r for n, g in (("a", 4), ("b", 1), ("c", 8)) for r in lay.ranks_of(n, g)]
    assert ranks == list(range(14))
    with pytest.raises(ValueError):
        group_layout({"a": 0})


def test_flush_on_the_last_bucket_unless_requests_keep_running_in_place():
    assert bucket_flags("abort", last=True) == {"flush_cache": True, "abort_all_requests": False}
    assert bucket_flags("abort", last=False)["flush_cache"] is False
    # retract: the requests wait with their KV freed; without a flush they would reuse prefix KV
    # the old weights computed (SGLang allows the flush then: waiting requests do not count)
    assert bucket_flags("retract", last=True)["flush_cache"] and not bucket_flags("retract", last=False)["flush_cache"]
    # in_place: the requests keep running on their KV (SGLang's documented semantics): no flush
    assert not bucket_flags("in_place", last=True)["flush_cache"]
    # no pause: the caller drained the instance, so it is empty as after an abort pause
    assert bucket_flags(None, last=True)["flush_cache"] and not bucket_flags(None, last=False)["flush_cache"]
    with pytest.raises(ValueError):
        bucket_flags("drain", True)


def test_wire_rids_are_prefix_free():
    ids = [f"g{g}.{i}" for g in range(120) for i in range(12)]
    wires = [wire_rid(x) for x in ids]
    assert any(a.startswith(b) for a, b in itertools.permutations(ids, 2))  # the raw ids are not
    assert not any(a.startswith(b) for a, b in itertools.permutations(wires, 2))
    with pytest.raises(ValueError):
        wire_rid("a#b")


def test_loads_are_summed_over_dp_ranks():
    # SGLang 0.5.23: num_total_tokens is used + waiting tokens; the pool is max_total_num_tokens
    body = {"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 50,
                       "num_total_tokens": 90, "max_total_num_tokens": 100, "token_usage": 0.5},
                      {"dp_rank": 1, "num_running_reqs": 2, "num_used_tokens": 10, "num_total_tokens": 10,
                       "max_total_num_tokens": 100, "token_usage": 0.1}]}
    assert summarize_loads(body) == {"num_running_reqs": 5, "num_waiting_reqs": 1, "kv_usage": 0.3}
    assert summarize_loads({"nothing": 1}) is None


def test_attention_dp_is_emitted_as_attn_dp_size_and_flashinfer_a2a_needs_it_equal_to_tp():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "sglang.tp_size=4", "sglang.ep_size=4",
                             "sglang.attn_dp_size=4", "sglang.moe_a2a_backend=flashinfer"])
    f = _flags(list(server_argv(_inst(), cfg.sglang, cfg.rollout)))
    assert f["--attn-dp-size"] == "4" and f["--moe-a2a-backend"] == "flashinfer"
    assert "--enable-dp-attention" not in f  # deprecated in 0.5.23: sets nothing by itself
    plain = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "sglang.tp_size=4"])
    assert "--attn-dp-size" not in _flags(list(server_argv(_inst(), plain.sglang, plain.rollout)))
    for bad in (["sglang.tp_size=4", "sglang.attn_dp_size=3"],
                ["sglang.tp_size=4", "sglang.ep_size=4", "sglang.attn_dp_size=2", "sglang.moe_a2a_backend=flashinfer"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", *bad])
        assert err.value.path == "sglang.attn_dp_size"


def test_cpu_instances_each_start_at_device_id_0_with_the_cpu_engine_and_one_thread_pool():
    """configs/cpu_sglang.yaml: two instances on one CPU. SGLang takes --base-gpu-id as the NUMA node
    to bind (a second instance given 1 dies: one NUMA node here), so both start at 0, with
    --device cpu, SGLANG_USE_CPU_ENGINE=1 and OMP_NUM_THREADS = rollout.threads_per_instance."""
    from pathlib import Path

    from dora_megatron.rollout.sglang.launch import local_sglang_engines

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "cpu_sglang.yaml",
                      ["rollout.threads_per_instance=3", "sglang.python=/venv/bin/python"])
    specs = local_sglang_engines(cfg, "/m", 31000)
    assert [s.name for s in specs] == ["engine0", "engine1"]
    for s in specs:
        f = _flags(list(s.argv[3:]))
        assert s.argv[0] == "/venv/bin/python" and f["--base-gpu-id"] == "0" and f["--device"] == "cpu"
        assert f["--attention-backend"] == "torch_native" and "--sleep-on-idle" in f
        assert f["--cuda-graph-backend-decode"] == f["--cuda-graph-backend-prefill"] == "disabled"
        assert "--disable-overlap-schedule" in f and f["--max-total-tokens"] == "4096"
        assert s.env["SGLANG_USE_CPU_ENGINE"] == "1" and s.env["OMP_NUM_THREADS"] == "3" and s.gpus == ()
    assert {_flags(list(s.argv[3:]))["--port"] for s in specs} == {"31000", "31010"}
    gpu = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "trainer.device=cuda"])
    on_gpu = local_sglang_engines(gpu, "/m", 31000)
    assert [_flags(list(s.argv[3:]))["--base-gpu-id"] for s in on_gpu] == ["1", "2"]  # after the trainer's GPU
    assert all("--device" not in s.argv and s.env == {} for s in on_gpu)


@pytest.mark.parametrize("key", ["algo.routing_replay", "algo.router_agreement"])
def test_routed_experts_with_sglang_on_cpu_are_refused_naming_the_key(key):
    """SGLang 0.5.23 dies at start with --enable-return-routed-experts on CPU (its routed-experts
    buffer is registered with CUDA; tests/integration/test_sglang_real.py shows it on a real server)."""
    with pytest.raises(ConfigError, match="algo.routing_replay.*cannot start on CPU"):
        load_config(None, ["rollout.engine=sglang", "rollout.device=cpu", f"{key}=true"])
    load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", f"{key}=true"])  # on GPUs it is the R3 path
