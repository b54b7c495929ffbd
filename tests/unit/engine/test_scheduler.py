"""Continuous batching, finish rules, pause modes, versions, migration and the KV kept between a
trajectory's turns on the scheduler core."""

from __future__ import annotations

import pytest
import torch

from dora_megatron.rollout.engine.model import load_model
from dora_megatron.rollout.engine.kv_cache import blocks_for
from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
from dora_megatron.comm.protocol import ProtocolError, SamplingParams


class Collector:
    def __init__(self) -> None:
        self.done: dict[str, dict] = {}

    def __call__(self, resp: dict) -> None:
        self.done[resp["meta_info"]["id"]] = resp


def mk(rid, prompt, sink, n=12, **sp):
    sp.setdefault("ignore_eos", True)
    return Request(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=n, **sp), return_logprob=True, on_done=sink)


def run(s: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not s.can_step():
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def lps(resp):
    return [x[0] for x in resp["meta_info"]["output_token_logprobs"]]


PROMPTS = [[5 + i, 20 + 2 * i, 30] * (2 + i) for i in range(6)]


@pytest.fixture
def sched(moe_model):
    return Scheduler(moe_model, SchedulerLimits(max_running=4))


def test_batched_greedy_equals_alone(moe_model):
    alone = {}
    for i, p in enumerate(PROMPTS):
        sink = Collector()
        s = Scheduler(moe_model, SchedulerLimits(max_running=1))
        s.submit(mk(f"r{i}", p, sink, temperature=0.0))
        run(s)
        alone[f"r{i}"] = sink.done[f"r{i}"]
    sink = Collector()
    s = Scheduler(moe_model, SchedulerLimits(max_running=4))  # 6 requests, cap 4: joins/leaves mid-run
    for i, p in enumerate(PROMPTS):
        s.submit(mk(f"r{i}", p, sink, n=12 - i, temperature=0.0))
    peak = 0
    while s.can_step():
        s.step()
        peak = max(peak, len(s.running))
    assert peak == 4
    for i in range(len(PROMPTS)):
        got, ref = sink.done[f"r{i}"], alone[f"r{i}"]
        assert got["output_ids"] == ref["output_ids"][: 12 - i]
        assert lps(got) == pytest.approx(lps(ref)[: 12 - i], abs=1e-4)
    assert len({tuple(r["output_ids"]) for r in alone.values()}) > 1  # prompts lead to different outputs


def test_request_joins_running_batch(sched):
    sink = Collector()
    sched.submit(mk("a", PROMPTS[0], sink, n=20, temperature=0.0))
    for _ in range(5):
        sched.step()
    sched.submit(mk("b", PROMPTS[1], sink, n=3, temperature=0.0))
    sched.step()
    assert {r.rid for r in sched.running} == {"a", "b"}
    run(sched)
    assert len(sink.done["a"]["output_ids"]) == 20 and len(sink.done["b"]["output_ids"]) == 3
    assert sched.pool.used == 0


def test_finish_reasons(sched, moe_model):
    sink = Collector()
    sched.submit(mk("len", PROMPTS[0], sink, n=4, temperature=0.0))
    run(sched)
    first = sink.done["len"]["output_ids"]
    assert sink.done["len"]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    sched.submit(mk("stop", PROMPTS[0], sink, n=10, temperature=0.0, stop_token_ids=[first[2]]))
    run(sched)
    out = sink.done["stop"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}
    assert out["output_ids"] == first[: first.index(first[2]) + 1]
    sched.submit(mk("zero", PROMPTS[0], sink, n=0))
    assert sink.done["zero"]["output_ids"] == [] and sched.is_idle()


def test_eos_stops_unless_ignored(moe_model):
    eos = next(iter(moe_model.config.eos_token_ids))
    s = Scheduler(moe_model, SchedulerLimits(max_running=2))
    sink = Collector()
    s.submit(mk("probe", PROMPTS[2], sink, n=3, temperature=0.0))
    run(s)
    second = sink.done["probe"]["output_ids"][1]
    s.eos_ids = {second}  # make the model's 2nd greedy token act as EOS
    s.submit(mk("eos", PROMPTS[2], sink, n=10, temperature=0.0, ignore_eos=False))
    s.submit(mk("ign", PROMPTS[2], sink, n=10, temperature=0.0, ignore_eos=True))
    run(s)
    assert sink.done["eos"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": second}
    assert len(sink.done["ign"]["output_ids"]) == 10
    assert eos is not None


def test_context_limit_and_bad_prompts(moe_model):
    s = Scheduler(moe_model, SchedulerLimits(max_running=2, max_context=16))
    sink = Collector()
    with pytest.raises(ProtocolError, match="context length is 16"):
        s.submit(mk("long", [5] * 16, sink))
    with pytest.raises(ProtocolError, match="outside"):
        s.submit(mk("vocab", [5, 100000], sink))
    s.submit(mk("ok", [5] * 10, sink, n=50, temperature=0.0))
    with pytest.raises(ProtocolError, match="already in use"):
        s.submit(mk("ok", [5], sink))
    run(s)
    assert len(sink.done["ok"]["output_ids"]) == 6  # stopped at the context length
    assert sink.done["ok"]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_returns_partial_output(sched):
    sink = Collector()
    sched.submit(mk("abc-1", PROMPTS[0], sink, n=50, temperature=0.0))
    sched.submit(mk("abc-2", PROMPTS[1], sink, n=50, temperature=0.0))
    sched.submit(mk("zzz", PROMPTS[1], sink, n=5, temperature=0.0))
    for _ in range(3):
        sched.step()
    sched.submit(mk("abc", PROMPTS[2], sink, n=50, temperature=0.0))
    assert sched.abort("abc") == 1  # exact match first
    assert sink.done["abc"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert sched.abort("abc") == 2  # then prefix match, as SGLang
    assert sched.abort("nope") == 0
    for rid in ("abc-1", "abc-2"):
        r = sink.done[rid]
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(r["output_ids"]) == 3 and len(r["meta_info"]["output_token_logprobs"]) == 3
    run(sched)
    assert len(sink.done["zzz"]["output_ids"]) == 5


def test_pause_modes(moe_model):
    ref_sink = Collector()
    s = Scheduler(moe_model, SchedulerLimits(max_running=2))
    s.submit(mk("x", PROMPTS[3], ref_sink, n=10, temperature=0.0))
    run(s)
    ref = ref_sink.done["x"]

    sink = Collector()
    s.submit(mk("x", PROMPTS[3], sink, n=10, temperature=0.0))
    s.step(), s.step()
    s.pause("in_place")
    assert not s.can_step() and s.step() == 0
    with pytest.raises(ProtocolError, match="cannot flush"):
        s.flush_cache()
    s.resume()
    s.step()
    s.pause("retract")
    assert not s.running and len(s.waiting) == 1 and s.pool.used == 0
    s.resume()
    run(s)
    assert sink.done["x"]["output_ids"] == ref["output_ids"]  # retract recomputes the KV, same tokens
    assert lps(sink.done["x"]) == pytest.approx(lps(ref), abs=1e-4)

    s.submit(mk("y", PROMPTS[3], sink, n=10, temperature=0.0))
    s.step()
    s.pause("abort")
    assert sink.done["y"]["meta_info"]["finish_reason"]["type"] == "abort"
    s.flush_cache()  # idle now


def _migrated_vs_plain(moe_model, split: int, **sp):
    plain_sink = Collector()
    a = Scheduler(moe_model, SchedulerLimits(max_running=2))
    a.submit(mk("m", PROMPTS[4], plain_sink, n=16, **sp))
    run(a)

    sink_a, sink_b = Collector(), Collector()
    a.submit(mk("m", PROMPTS[4], sink_a, n=16, **sp))
    for _ in range(split):
        a.step()
    blob = a.export_request("m")
    assert a.is_idle() and a.pool.used == 0
    src = sink_a.done["m"]
    assert src["meta_info"]["finish_reason"]["err_type"] == "migrated" and src["meta_info"]["dora_migrated"]
    b = Scheduler(moe_model, SchedulerLimits(max_running=2))
    b.import_request(blob, sink_b)
    b.step()
    assert b.running[0].kv.length == len(PROMPTS[4]) + split  # continued from the KV: no re-prefill
    run(b)
    return plain_sink.done["m"], sink_b.done["m"], src


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=1.0, sampling_seed=1234, top_p=0.95)])
def test_migrated_request_matches_unmigrated_exactly(moe_model, sp):
    plain, migrated, src = _migrated_vs_plain(moe_model, 5, **sp)
    assert migrated["output_ids"] == plain["output_ids"]
    assert lps(migrated) == lps(plain)  # bit-exact: same KV, same RNG stream
    assert src["output_ids"] == plain["output_ids"][:5]
    assert migrated["meta_info"]["dora_migrations"] == 1


def test_seeded_sampling_reproducible_and_seed_dependent(moe_model):
    outs = []
    for seed in (7, 7, 8):
        sink = Collector()
        s = Scheduler(moe_model, SchedulerLimits(max_running=2))
        s.submit(mk("s", PROMPTS[0], sink, n=16, temperature=1.0, sampling_seed=seed))
        run(s)
        outs.append(sink.done["s"]["output_ids"])
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_version_checks_on_submit_and_import(moe_model):
    a = Scheduler(moe_model, SchedulerLimits(max_running=2), weight_version="3")
    b = Scheduler(moe_model, SchedulerLimits(max_running=2), weight_version="4")
    sink = Collector()
    with pytest.raises(ProtocolError) as e:
        a.submit(mk("v", PROMPTS[0], sink), required_version="4")
    assert e.value.status == 409 and "holds version 3" in e.value.message
    a.submit(mk("v", PROMPTS[0], sink, n=8, temperature=0.0), required_version="3")
    a.step()
    blob = a.export_request("v")
    with pytest.raises(ProtocolError) as e:
        b.import_request(blob, sink)
    assert e.value.status == 409
    with pytest.raises(ProtocolError, match="not an exported request"):
        b.import_request(b"garbage", sink)
    with pytest.raises(ProtocolError) as e:
        a.export_request("unknown")
    assert e.value.status == 404


def test_failed_weight_update_keeps_weights_and_version(moe_dir):
    m = load_model(moe_dir)
    s = Scheduler(m, SchedulerLimits(max_running=1), weight_version="0")
    before = s.weights_checksum()
    bad = {"model.norm.weight": torch.zeros(128), "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(ProtocolError, match="old weights kept"):
        s.load_weights(bad, "1", require_all=False)
    assert s.weight_version == "0" and s.weights_checksum() == before
    s.load_weights({"model.norm.weight": torch.full((128,), 2.0)}, "1", require_all=False)
    assert s.weight_version == "1" and s.weights_checksum() != before


def test_admission_respects_kv_budget(moe_model):
    s = Scheduler(moe_model, SchedulerLimits(max_running=8, kv_blocks=3, block_size=16))
    sink = Collector()
    s.submit(mk("a", [5] * 20, sink, n=10))  # 30 tokens -> 2 blocks
    s.submit(mk("b", [5] * 20, sink, n=10))
    s.step()
    assert len(s.running) == 1 and len(s.waiting) == 1 and s.info()["kv_usage"] == pytest.approx(2 / 3)
    run(s)
    assert set(sink.done) == {"a", "b"}
    with pytest.raises(ProtocolError, match="KV blocks"):
        s.submit(mk("huge", [5] * 40, sink, n=20))


def test_weight_change_aborts_requests_pinned_to_old_version(moe_dir):
    m = load_model(moe_dir)
    s = Scheduler(m, SchedulerLimits(max_running=4), weight_version="1")
    sink = Collector()
    s.submit(mk("pinned", PROMPTS[0], sink, n=30, temperature=0.0), required_version="1")
    s.submit(mk("free", PROMPTS[1], sink, n=30, temperature=0.0))
    s.step()
    s.pause("in_place")
    s.load_weights({"model.norm.weight": torch.full((128,), 1.5)}, "2", require_all=False)
    reason = sink.done["pinned"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["err_type"] == "version_changed" and reason["status_code"] == 409
    assert len(sink.done["pinned"]["output_ids"]) == 1
    s.resume()
    run(s)
    assert len(sink.done["free"]["output_ids"]) == 30  # unpinned requests follow SGLang's in-place semantics


# ---- a trajectory's KV kept between its turns (dora_keep_kv) ----------------------------------

TOOL = [7, 8, 9, 10, 11]  # what the environment appends between the turns


def _sched(model, **kw) -> Scheduler:
    return Scheduler(model, SchedulerLimits(max_running=2, block_size=4, **kw))


def _turn(s: Scheduler, rid: str, prompt: list[int], n: int = 6, keep: bool = True, **sp) -> dict:
    sink = Collector()
    req = mk(rid, prompt, sink, n=n, temperature=0.0, **sp)
    req.keep_kv = keep
    s.submit(req)
    run(s)
    return sink.done[rid]


def test_the_next_turn_computes_only_the_new_tokens_and_answers_as_a_full_prefill(moe_model):
    s = _sched(moe_model)
    first = _turn(s, "t", PROMPTS[3])
    context = PROMPTS[3] + first["output_ids"]
    kept = len(context) - 1  # every token but the last sampled one
    assert s.pool.used == blocks_for(kept, 4) and s.info()["kv_kept_blocks"] == blocks_for(kept, 4)
    before = s.tokens_computed
    second = _turn(s, "t", context + TOOL, keep=False)
    assert s.tokens_computed - before == len(context + TOOL) - kept + 6 - 1  # the rest of the prefix, then decode
    assert s.info()["kv_kept_reused_tokens"] == kept and s.pool.used == 0
    fresh = _sched(moe_model)
    plain = _turn(fresh, "t", context + TOOL, keep=False)
    assert second["output_ids"] == plain["output_ids"]
    assert lps(second) == pytest.approx(lps(plain), abs=1e-4)


def test_kept_blocks_are_freed_when_released_expired_evicted_or_the_weights_change(moe_dir):
    now = [0.0]
    s = _sched(load_model(moe_dir), kv_blocks=40, kept_kv_s=10.0, kept_kv_fraction=0.5)
    s.kept.clock = lambda: now[0]
    _turn(s, "a", PROMPTS[0])
    _turn(s, "b", PROMPTS[1])
    held = s.kept.blocks
    assert held == s.pool.used > 0 and set(s.kept.entries) == {"a", "b"}
    assert s.release_kept("a") and not s.release_kept("a")
    assert s.pool.used == s.kept.blocks == held - blocks_for(len(PROMPTS[0]) + 5, 4)
    now[0] = 11.0  # past kept_kv_s: gone at the next look
    s.kept.expire()
    assert s.pool.used == 0 and not s.kept.entries
    _turn(s, "c", PROMPTS[2])
    s.load_weights({"model.norm.weight": torch.full((128,), 1.5)}, "1", require_all=False)
    assert s.pool.used == 0 and not s.kept.entries  # computed with the old weights
    # admission takes blocks from the kept turns: a request needing the whole pool still runs
    _turn(s, "d", PROMPTS[2])
    assert s.kept.blocks > 0
    sink = Collector()
    s.submit(mk("big", [5] * 100, sink, n=60))
    run(s)
    assert "big" in sink.done and not s.kept.entries and s.pool.used == 0


def test_the_budget_bounds_the_kept_blocks_oldest_first(moe_model):
    s = _sched(moe_model, kv_blocks=40, kept_kv_fraction=0.25)  # 10 blocks for kept turns
    for i, rid in enumerate("abc"):
        _turn(s, rid, [5 + i] * 14, n=6)  # 19 kept tokens: 5 blocks each
    assert list(s.kept.entries) == ["b", "c"] and s.kept.blocks == 10 == s.pool.used


def test_the_kept_kv_moves_to_an_instance_of_the_same_version_only(moe_model):
    a, b = _sched(moe_model), _sched(moe_model)
    first = _turn(a, "t", PROMPTS[2])
    context = PROMPTS[2] + first["output_ids"]
    blob = a.export_kept("t")
    assert a.pool.used == 0 and not a.kept.entries
    with pytest.raises(ProtocolError) as err:
        a.export_kept("t")
    assert err.value.status == 404
    other = Scheduler(moe_model, SchedulerLimits(max_running=2, block_size=4), weight_version="3")
    with pytest.raises(ProtocolError) as err:
        other.import_kept(blob)
    assert err.value.status == 409 and other.pool.used == 0
    assert b.import_kept(blob) == len(context) - 1 and b.pool.used == blocks_for(len(context) - 1, 4)
    before = b.tokens_computed
    moved = _turn(b, "t", context + TOOL, keep=False)
    assert b.tokens_computed - before == len(TOOL) + 1 + 6 - 1  # only the tool's tokens (and the last one)
    plain = _turn(_sched(moe_model), "t", context + TOOL, keep=False)
    assert moved["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("field, value, message", [
    ("version", 0, r"^version must be a string, got 0$"),
    ("rid", "", r"^rid must be a string of length >= 1, got ''$"),
    ("tokens", "abc", r"^tokens must be a list, got 'abc'$"),
    ("tokens", [], r"^tokens must be a list of length >= 1, got \[\]$"),
    ("tokens", [1, 2.0], r"^tokens\[1\] must be an integer, got 2\.0$"),
    ("tokens", [1, 10**9], r"^tokens\[1\] must be a token id < \d+, got 1000000000$"),
])
def test_a_kept_kv_import_names_a_bad_field_and_value(moe_model, field, value, message):
    import io

    a = _sched(moe_model)
    _turn(a, "t", PROMPTS[2])
    blob = torch.load(io.BytesIO(a.export_kept("t")), weights_only=True)
    buf = io.BytesIO()
    torch.save({**blob, field: value}, buf)
    b = _sched(moe_model)
    with pytest.raises(ProtocolError, match=message) as err:
        b.import_kept(buf.getvalue())
    assert err.value.status == 400 and b.pool.used == 0 and not b.kept.entries


def test_a_bf16_instance_keeps_and_moves_its_kv_in_bf16_and_the_next_turn_is_the_same_anywhere(moe_dir):
    """In bf16 a full prefill need not equal the kept KV's incremental one, so the check is the
    move itself: the next turn on the instance the KV was carried to answers exactly as on an
    instance that kept the same KV (same tokens, same log-probs), and the KV travels as bf16."""
    import io

    model = load_model(moe_dir, dtype=torch.bfloat16)
    a, stayed = _sched(model), _sched(model)
    first = _turn(a, "t", PROMPTS[2])
    assert _turn(stayed, "t", PROMPTS[2])["output_ids"] == first["output_ids"]
    context = PROMPTS[2] + first["output_ids"]
    blob = a.export_kept("t")
    kv = torch.load(io.BytesIO(blob), weights_only=True)["kv"]
    assert kv.dtype == torch.bfloat16 and kv.shape[3] == len(context) - 1
    b = _sched(model)
    assert b.import_kept(blob) == len(context) - 1
    moved = _turn(b, "t", context + TOOL, keep=False)
    here = _turn(stayed, "t", context + TOOL, keep=False)
    assert moved["output_ids"] == here["output_ids"] and lps(moved) == lps(here)
    assert b.info()["kv_kept_reused_tokens"] == len(context) - 1 and b.pool.used == 0


def test_the_kept_kv_keys_reach_dora_serve_and_a_zero_share_keeps_nothing(moe_model):
    import argparse
    from pathlib import Path

    from dora_megatron.cli import serve
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.plan import local_plan

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs" / "cpu_tiny.yaml", ["rollout.kept_kv_s=5", "rollout.kept_kv_fraction=0"])
    argv = list(next(p.argv for p in local_plan(cfg, "/m", "/r") if p.role == "engine"))
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(["0" if a == "<free-port>" else a for a in argv[argv.index("serve") + 1 :]])
    assert (args.kept_kv_s, args.kept_kv_fraction) == (5.0, 0.0)
    with pytest.raises(ConfigError, match="rollout.kept_kv_fraction"):
        load_config(root / "configs" / "cpu_tiny.yaml", ["rollout.kept_kv_fraction=1.5"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/m", "--port", "0", "--kept-kv-fraction", "1.5"])
    s = _sched(moe_model, kept_kv_fraction=args.kept_kv_fraction)
    _turn(s, "t", PROMPTS[3])
    assert s.pool.used == 0 and not s.kept.entries  # no share: the finished turn's KV is freed at once


def test_a_kept_kv_of_another_context_is_not_used(moe_model):
    s = _sched(moe_model)
    _turn(s, "t", PROMPTS[3])
    before = s.tokens_computed
    _turn(s, "t", PROMPTS[4], keep=False)  # the rid runs again from another prompt: all computed
    assert s.tokens_computed - before == len(PROMPTS[4]) + 6 - 1
    assert s.info()["kv_kept_reused_tokens"] == 0 and s.pool.used == 0
