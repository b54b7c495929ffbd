"""Per-request token sampling with a per-request RNG, and the logprob of the chosen token.

Why per request: a request's random stream must not depend on which other requests share its
batch, and it must travel with the request when it migrates, so each request owns a
``torch.Generator`` (seeded from ``sampling_seed`` when given) whose state is exported.

Semantics (as SGLang's sampler): temperature below ``SAMPLING_EPS`` (or top_k 1) is greedy (argmax) and the logprob
is ``log_softmax(logits)``; otherwise logits are divided by the temperature, the reported
logprob is ``log_softmax(logits / T)`` of the chosen token (before top-k/top-p truncation), and
the token is drawn from the top-k/top-p truncated, renormalised distribution.
"""

from __future__ import annotations

import secrets

import torch

from dora_megatron.comm.protocol import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """CPU generator seeded from ``seed`` (a fresh random seed when None)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return g


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the tokens outside top-k and the top-p nucleus of a 1-D distribution; renormalise."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Choose the next token from 1-D ``logits``; return ``(token_id, logprob)``."""
    logits = logits.to(torch.float32)
    if params.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = truncate_probs(logp.exp(), params.top_k, params.top_p)
    tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return tok, float(logp[tok])
