"""Routing replay (R3) in the Megatron trainer, layouts 1 / EP=2 / TP=2, against transformers with the
routing forced by hand (a forward hook on each ``Qwen3MoeTopKRouter`` returns the given experts).

The forced experts are random (not what either model would choose), so a match proves every MoE
layer of the trainer routed every token to exactly the given experts."""

from __future__ import annotations


import pytest
import torch

from tests.helpers.trainer_scenarios import make_hf_model, run_scenario

pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")


def _batch():
    from tests.helpers.trainer_programs import fixed_batch

    return fixed_batch(128, seed=0)


def _random_routing(batch, layers: int, experts: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = []
    for s in batch:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        out.append(torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                                for _ in range(n)]).to(torch.int32))
    return out


def _hf_forward(hf_dir: str, batch, forced: list[torch.Tensor] | None, renormalise: bool = True):
    """Per-sample response log-probs from transformers (routing forced when ``forced``; the forced
    experts' weights are the softmax over all experts, renormalised over the top-k when
    ``renormalise``, as the family's router does, or for a sigmoid router (GLM-4.5, DeepSeek-V3) the experts'
    unbiased sigmoid scores renormalised and scaled), and the natural top-k per position when not
    forced (``[n, layers, k]``, dense layers' rows 0)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    routers = {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}
    sigmoid = hf.config.model_type in ("glm4_moe", "deepseek_v3")
    state: dict = {}

    def hook(mod, inp, out, layer):
        logits = out[0]
        if state.get("forced") is None:
            state.setdefault("natural", {})[layer] = out[2].clone()
            return None
        idx = torch.arange(mod.top_k).expand(logits.shape[0], -1).clone()
        n = state["forced"].shape[0]
        idx[:n] = state["forced"][:, layer].long()
        if sigmoid:
            w = torch.sigmoid(logits.float()).gather(1, idx)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * mod.routed_scaling_factor
        elif renormalise:
            w = torch.softmax(logits.float().gather(1, idx), -1).to(logits.dtype)
        else:
            w = torch.softmax(logits.float(), -1).gather(1, idx).to(logits.dtype)
        return logits, w, idx

    handles = [r.register_forward_hook(lambda m, i, o, layer=layer: hook(m, i, o, layer))
               for layer, r in routers.items()]
    lps, natural = [], []
    with torch.no_grad():
        for j, s in enumerate(batch):
            ids = s.prompt_ids + s.response_ids
            state.clear()
            state["forced"] = None if forced is None else forced[j]
            logits = hf(torch.tensor([ids])).logits[0].float()
            p = len(s.prompt_ids)
            lp = torch.log_softmax(logits, -1)[p - 1:len(ids) - 1].gather(1, torch.tensor(s.response_ids)[:, None])
            lps.append(lp[:, 0])
            if forced is None:
                k = next(iter(state["natural"].values())).shape[1]
                natural.append(torch.stack([state["natural"][layer][:-1] if layer in routers else
                                            torch.zeros((len(ids) - 1, k), dtype=torch.int64)
                                            for layer in range(len(hf.model.layers))], 1))
    for h in handles:
        h.remove()
    return lps, natural


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    hf_dir = make_hf_model(str(root / "moe"), moe=True)
    batch = _batch()
    forced = _random_routing(batch, layers=2, experts=8, k=2)
    torch.save(forced, str(root / "forced.pt"))
    ref_lps, _ = _hf_forward(hf_dir, batch, forced)
    plain_lps, natural = _hf_forward(hf_dir, batch, None)
    torch.save([n.to(torch.int32) for n in natural], str(root / "natural.pt"))
    return {"root": root, "hf": hf_dir, "batch": batch, "forced": forced, "ref": ref_lps, "plain": plain_lps,
            "natural": natural}


def _scenario(setup, routing: str, nproc: int, extra: list[str], name: str) -> dict:
    root = setup["root"]
    return run_scenario(["replay", "--hf", setup["hf"], "--routing", str(root / routing), *extra], nproc,
                        str(root / f"{name}.pt"))


def _close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_replay_single_rank_uses_exactly_the_given_experts(setup):
    res = _scenario(setup, "forced.pt", 1, ["--replay"], "one")
    # the random routing is not the trainer's own: agreement measured before replay is low
    assert res["agreement"] is not None and res["agreement"] < 0.5
    _close(res["logprobs"], setup["ref"])
    assert max((a - b).abs().max().item() for a, b in zip(res["logprobs"], setup["plain"])) > 1e-2
    # the routers' routing maps: per micro-batch (one sample each), every real position -> the given experts
    maps = res["routing_maps"]
    for layer in range(2):
        for j, forced in enumerate(setup["forced"]):
            used = maps[layer][j][: forced.shape[0]]  # [positions, experts] bool (padding rows follow)
            want = torch.zeros_like(used)
            want.scatter_(1, forced[:, layer].long(), True)
            assert torch.equal(used.bool(), want.bool()), (layer, j)
    assert res["metrics"]["routing_replay"] == 1.0 and res["metrics"]["router_topk_agreement"] < 0.5


def test_agreement_is_one_for_the_trainers_own_routing_and_no_replay_means_own_routing(setup):
    res = _scenario(setup, "natural.pt", 1, [], "natural")
    assert res["agreement"] == 1.0
    _close(res["logprobs"], setup["plain"])
    assert res["metrics"]["routing_replay"] == 0.0


@pytest.mark.parametrize("layout", [["--ep", "2"], ["--tp", "2"]], ids=["ep2", "tp2"])
def test_replay_in_parallel_layouts_matches_forced_reference(setup, layout):
    res = _scenario(setup, "forced.pt", 2, ["--replay", *layout], "-".join(layout).strip("-"))
    _close(res["logprobs"], setup["ref"])
    assert res["agreement"] < 0.5 and res["metrics"]["routing_replay"] == 1.0


@pytest.mark.parametrize("family,renormalise", [("qwen2_moe", False), ("mixtral", True)])
def test_replay_uses_exactly_the_given_experts_for_each_families_router(tmp_path, family, renormalise):
    """Qwen2-MoE's softmax router without renormalisation (and its gated shared expert beside the
    routed ones) and Mixtral's renormalised top-2 replay the given random experts with their weights."""
    from tests.helpers.trainer_programs import fixed_batch
    from tests.helpers.hf_dirs import VOCAB, save_family

    hf_dir = str(save_family(tmp_path / family, family))
    batch = fixed_batch(VOCAB, seed=0)
    forced = _random_routing(batch, layers=2, experts=4, k=2)
    torch.save(forced, str(tmp_path / "forced.pt"))
    ref, _ = _hf_forward(hf_dir, batch, forced, renormalise)
    plain, _ = _hf_forward(hf_dir, batch, None)
    res = run_scenario(["replay", "--hf", hf_dir, "--routing", str(tmp_path / "forced.pt"), "--replay"], 1,
                       str(tmp_path / "r.pt"))
    _close(res["logprobs"], ref)
    assert max((a - b).abs().max().item() for a, b in zip(res["logprobs"], plain)) > 1e-2
    assert res["metrics"]["routing_replay"] == 1.0


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_biased_grouped_sigmoid_routing_is_the_trainers_and_replays_exactly(tmp_path, family):
    """GLM-4.5's and DeepSeek-V3's router (sigmoid scores, experts chosen on scores +
    e_score_correction_bias within the best of 2 groups, weighted by the unbiased scores,
    renormalised, times 2.5; the first layer dense; DeepSeek-V3 with multi-latent attention): the
    trainer's own choice equals transformers' at every position (agreement 1 with the natural
    routing, which the random correction bias changes), and random forced experts replay with their
    weights."""
    from tests.helpers.trainer_programs import fixed_batch
    from tests.helpers.hf_dirs import VOCAB, save_family

    hf_dir = str(save_family(tmp_path / family, family))
    batch = fixed_batch(VOCAB, seed=0)
    plain, natural = _hf_forward(hf_dir, batch, None)
    torch.save([n.to(torch.int32) for n in natural], str(tmp_path / "natural.pt"))
    # the correction bias matters: without it transformers would route many positions elsewhere
    unbiased = tmp_path / "unbiased"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    model.save_pretrained(str(unbiased))
    _, natural_unbiased = _hf_forward(str(unbiased), batch, None)
    moved = sum(int((a[:, 1].sort(-1).values != b[:, 1].sort(-1).values).any(-1).sum())
                for a, b in zip(natural, natural_unbiased))
    assert moved > 10, moved
    res = run_scenario(["replay", "--hf", hf_dir, "--routing", str(tmp_path / "natural.pt")], 1, str(tmp_path / "n.pt"))
    assert res["agreement"] == 1.0
    _close(res["logprobs"], plain)

    forced = _random_routing(batch, layers=2, experts=8, k=2)
    torch.save(forced, str(tmp_path / "forced.pt"))
    ref, _ = _hf_forward(hf_dir, batch, forced)
    res = run_scenario(["replay", "--hf", hf_dir, "--routing", str(tmp_path / "forced.pt"), "--replay"], 1,
                       str(tmp_path / "r.pt"))
    _close(res["logprobs"], ref)
    assert max((a - b).abs().max().item() for a, b in zip(res["logprobs"], plain)) > 1e-2
    assert res["metrics"]["routing_replay"] == 1.0 and res["metrics"]["router_topk_agreement"] < 0.7
