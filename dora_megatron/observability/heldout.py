"""Held-out evaluation of a policy on a marked-digit task, overall and per list-length bucket.

Why: the training reward of an RL run mixes prompts of every length and moves with the sampling
noise of a few groups per step. A fixed set of held-out prompts (a prompt seed the run never
uses), answered by the initial weights and by the final ones in the same way, says whether the
policy improved and on which lengths. Sampling at the rollout temperature measures what RL
optimises; greedy decoding shows whether the most likely answer moved too.

Generation uses the Hugging Face reference implementation (``transformers``) on the snapshot
directories the run already writes, after the job's processes are gone, so it competes with
nothing and needs no engine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

#: Upper bounds of the length buckets (list length n <= b); 52 is the longest list a task allows.
BUCKETS = (1, 2, 4, 8, 16, 52)
#: Held-out prompts come from this prompt seed, far from any run's ``data.seed`` by default.
HELDOUT_SEED_OFFSET = 99


def bucket_of(n: int) -> int:
    """The bucket bound of a list of ``n`` digits."""
    return next(b for b in BUCKETS if n <= b)


@dataclass
class EvalResult:
    model: str
    decode: str
    exact: float
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "decode": self.decode, "exact": self.exact, "buckets": self.buckets}

    def line(self) -> str:
        per = " ".join(f"{k}:{v['exact']:.2f}" for k, v in self.buckets.items())
        return f"{self.decode:6} exact {self.exact:.3f}  {per}"


def heldout_prompts(task: str, min_len: int, max_len: int, exponent: float, data_seed: int, count: int) -> list:
    """``count`` prompts of ``task`` from the prompt seed ``data_seed + HELDOUT_SEED_OFFSET``."""
    from dora_megatron.data.tasks import RunningSumTask

    source = RunningSumTask(min_len, max_len, exponent, seed=data_seed + HELDOUT_SEED_OFFSET, kind=task)
    return [source.get(i) for i in range(count)]


def _load(model_dir: str | Path):
    import torch
    from transformers import AutoModelForCausalLM

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def generate_responses(model: Any, prompts: Sequence[Any], decode: str = "sample", *, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: Sequence[int] = (),
                       batch: int = 100, max_new_tokens: int = 96, seed: int = 0, codec: Any = None) -> list[list[int]]:
    """Response token ids of ``model`` (a loaded HF causal LM) for ``prompts``, each ending at its
    first EOS or ``stop_token_ids`` token (kept, as the engines keep it). Prompts are rendered by
    ``codec`` (:class:`~dora_megatron.data.codec.TextCodec`, the controller's renderer; default the
    character vocabulary). Sampling follows the rollout's parameters (``top_k`` -1 = off); the
    caller's torch RNG stream is left untouched."""
    import torch

    from dora_megatron.data.codec import CharCodec

    if decode not in ("sample", "greedy"):
        raise ValueError(f"decode must be 'sample' or 'greedy', got {decode!r}")
    codec = codec or CharCodec()
    stops = list(dict.fromkeys([*codec.eos_ids, *map(int, stop_token_ids)]))
    pad = codec.pad_id
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": max(0, top_k), "top_p": top_p}
                if decode == "sample" else {"do_sample": False})
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    out_ids: list[list[int]] = []
    try:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start: start + batch]
            ids = [codec.encode_prompt(p) for p in chunk]
            width = max(map(len, ids))
            inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            with torch.no_grad():
                out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     eos_token_id=stops, pad_token_id=pad, **sampling)
            for row in out[:, width:].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
                out_ids.append(row[:end])
    finally:
        torch.random.set_rng_state(generator_state)
    return out_ids


def evaluate_model(model_dir: str | Path, prompts: Sequence[Any], decode: str = "sample", *, temperature: float = 1.0,
                   top_p: float = 1.0, top_k: int = -1, stop_token_ids: Sequence[int] = (),
                   batch: int = 100, max_new_tokens: int = 96, seed: int = 0) -> EvalResult:
    """Exact-answer rate of ``model_dir`` on ``prompts`` (``decode``: ``sample`` or ``greedy``),
    decoded as the rollout decodes (its sampling parameters and stop tokens)."""
    from dora_megatron.data.codec import CharCodec
    from dora_megatron.data.tasks import running_sum_reward

    if decode not in ("sample", "greedy"):
        raise ValueError(f"decode must be 'sample' or 'greedy', got {decode!r}")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    responses = generate_responses(_load(model_dir), prompts, decode, temperature=temperature, top_p=top_p,
                                   top_k=top_k, stop_token_ids=stop_token_ids, batch=batch,
                                   max_new_tokens=max_new_tokens, seed=seed)
    per_bucket: dict[int, list[float]] = {}
    for p, row in zip(prompts, responses):
        per_bucket.setdefault(bucket_of(len(p.answer) // 2), []).append(running_sum_reward(CharCodec().decode(row), p.answer))
    rewards = [r for rs in per_bucket.values() for r in rs]
    buckets = {f"n<={b}": {"exact": statistics.fmean(per_bucket[b]), "prompts": len(per_bucket[b])}
               for b in sorted(per_bucket)}
    return EvalResult(str(model_dir), decode, statistics.fmean(rewards), buckets)


def latest_snapshot(run_dir: str | Path) -> Path | None:
    """The newest ``RUN_DIR/weights/vNNNNNN`` holding a complete snapshot, or None."""
    weights = Path(run_dir) / "weights"
    found = sorted(d for d in weights.glob("v[0-9]*") if (d / "model.safetensors").is_file()) if weights.is_dir() else []
    return found[-1] if found else None
