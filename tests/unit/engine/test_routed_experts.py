"""Routed experts (R3) from the embedded engine: SGLang 0.5.23's encoding, equal to transformers'
router top-k on the same sequence, and unchanged across a retract, a KV migration and start_len."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from dora_megatron.rollout.engine.routing_trace import RoutingTrace, routing_trace_for
from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
from dora_megatron.comm.protocol import GenerateRequest, ProtocolError, SamplingParams
from dora_megatron.comm.routed_experts import decode_routed_experts

PROMPT = [5, 17, 30, 41, 9, 12, 77, 3]
N_NEW = 10


class Sink(dict):
    def __call__(self, resp):
        self[resp["meta_info"]["id"]] = resp


def _req(model, rid, sink, start_len=0, temperature=0.0, seed=None):
    r = Request(rid=rid, prompt_ids=list(PROMPT), return_logprob=True, on_done=sink,
                params=SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=temperature,
                                      sampling_seed=seed))
    r.routing = routing_trace_for(model.config, start_len)
    return r


def _run(s):
    for _ in range(1000):
        if not s.can_step():
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def _sglang_decode(resp, model):
    """Decode exactly as SGLang's extract_routed_experts_from_meta_info does (numpy int32)."""
    c = model.config
    flat = np.frombuffer(base64.b64decode(resp["meta_info"]["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, c.num_layers, c.top_k)


def _generate(model, **kw):
    sink = Sink()
    s = Scheduler(model, SchedulerLimits(max_running=2))
    s.submit(_req(model, "a", sink, **kw))
    _run(s)
    return sink["a"]


def test_routed_experts_equal_transformers_router_topk(moe_model, moe_dir):
    transformers = pytest.importorskip("transformers")
    resp = _generate(moe_model)
    got = _sglang_decode(resp, moe_model)
    seq = PROMPT + resp["output_ids"]
    assert got.shape == (len(seq) - 1, moe_model.config.num_layers, moe_model.config.top_k)
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    with torch.no_grad():
        out = hf(torch.tensor([seq[:-1]]), output_router_logits=True)
    k = moe_model.config.top_k
    for layer, logits in enumerate(out.router_logits):
        ref = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices  # [T, k]
        assert torch.equal(torch.from_numpy(got[:, layer].copy()).long().sort(-1).values,
                           ref.sort(-1).values), f"layer {layer}"
    assert len({tuple(r) for r in got[:, 0].tolist()}) > 1  # tokens use different experts


def test_start_len_returns_the_tail_and_is_checked(moe_model):
    full = _sglang_decode(_generate(moe_model), moe_model)
    tail = _sglang_decode(_generate(moe_model, start_len=len(PROMPT)), moe_model)
    assert tail.shape[0] == N_NEW - 1 and np.array_equal(tail, full[len(PROMPT):])
    s = Scheduler(moe_model, SchedulerLimits(max_running=2))
    with pytest.raises(ProtocolError, match="routed_experts_start_len"):
        s.submit(_req(moe_model, "x", Sink(), start_len=len(PROMPT) + 1))
    g = GenerateRequest.from_json({"input_ids": PROMPT, "return_routed_experts": True,
                                   "routed_experts_start_len": 3})
    assert (g.return_routed_experts, g.routed_experts_start_len) == (True, 3)
    assert GenerateRequest.from_json(g.to_json()) == g
    with pytest.raises(ProtocolError, match="routed_experts_start_len"):
        GenerateRequest.from_json({"input_ids": PROMPT, "routed_experts_start_len": -1})


def test_retract_and_migration_keep_routing(moe_model):
    ref = _generate(moe_model, temperature=1.0, seed=3)
    # retract: KV dropped, the request re-prefills prompt + partial output later
    sink = Sink()
    s = Scheduler(moe_model, SchedulerLimits(max_running=2))
    s.submit(_req(moe_model, "a", sink, temperature=1.0, seed=3))
    for _ in range(4):
        s.step()
    s.pause("retract")
    s.resume()
    _run(s)
    assert sink["a"]["output_ids"] == ref["output_ids"]
    assert sink["a"]["meta_info"]["routed_experts"] == ref["meta_info"]["routed_experts"]
    # migration: export mid-generation, import elsewhere, finish there without re-prefill
    src_sink, dst_sink = Sink(), Sink()
    a = Scheduler(moe_model, SchedulerLimits(max_running=2))
    b = Scheduler(moe_model, SchedulerLimits(max_running=2))
    a.submit(_req(moe_model, "a", src_sink, temperature=1.0, seed=3))
    for _ in range(5):
        a.step()
    b.import_request(a.export_request("a"), dst_sink)
    steps_before = b.steps
    b.step()
    assert b.running[0].kv.length == len(PROMPT) + 5  # decode only: no re-prefill
    _run(b)
    assert b.steps > steps_before
    assert dst_sink["a"]["output_ids"] == ref["output_ids"]
    assert dst_sink["a"]["meta_info"]["routed_experts"] == ref["meta_info"]["routed_experts"]


def test_import_refuses_inconsistent_routing(moe_model):
    import io

    a = Scheduler(moe_model, SchedulerLimits(max_running=2))
    a.submit(_req(moe_model, "a", Sink()))
    for _ in range(3):
        a.step()
    blob = torch.load(io.BytesIO(a.export_request("a")), weights_only=True)
    c = moe_model.config
    for bad in (blob["routing"]["rows"][:-1], blob["routing"]["rows"].long(),
                torch.full_like(blob["routing"]["rows"], c.num_experts)):
        buf = io.BytesIO()
        torch.save({**blob, "routing": {"start_len": 0, "rows": bad}}, buf)
        with pytest.raises(ProtocolError, match="routing.rows"):
            Scheduler(moe_model, SchedulerLimits(max_running=2)).import_request(buf.getvalue(), Sink())


def test_requests_without_the_flag_get_no_routing_and_dense_is_refused(moe_model):
    sink = Sink()
    s = Scheduler(moe_model, SchedulerLimits(max_running=2))
    s.submit(Request(rid="p", prompt_ids=PROMPT, params=SamplingParams(max_new_tokens=3), on_done=sink))
    s.submit(_req(moe_model, "r", sink))
    _run(s)
    assert "routed_experts" not in sink["p"]["meta_info"]
    rows = decode_routed_experts(sink["r"]["meta_info"]["routed_experts"], moe_model.config.num_layers,
                                 moe_model.config.top_k)
    assert len(rows) == len(PROMPT) + N_NEW - 1

    class Dense:
        is_moe = False

    with pytest.raises(ProtocolError, match="MoE"):
        routing_trace_for(Dense(), 0)
    assert len(RoutingTrace(2, 2)) == 0
