"""The migration export format of the embedded engine: a request (state, KV, RNG state) and a
kept turn's KV, serialised by one instance and read back (as untrusted input) by another.

WHY a module of its own: the format is a contract between two instances (and across versions of
this code), with its own validation; the scheduler (:mod:`.scheduler`) only removes a request
before :func:`dump_request` and queues the one :func:`request_from_blob` builds.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from dora_megatron.comm.protocol import ProtocolError, SamplingParams
from dora_megatron.models.hf_config import ModelSpec
from dora_megatron.rollout.engine.kept_kv import KeptEntry
from dora_megatron.rollout.engine.kv_cache import KVShape, RequestKV
from dora_megatron.rollout.engine.request import DoneCallback, Request
from dora_megatron.rollout.engine.speculator import MAX_DRAFT_SOURCES
from dora_megatron.rollout.speculation import DraftAcceptance

EXPORT_FORMAT = "dora-request-v1"
KV_EXPORT_FORMAT = "dora-kept-kv-v1"


def model_shape(c: ModelSpec) -> list[int]:
    """What an export names of the model its KV fits (an import checks it)."""
    return [c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size]


def dump_request(r: Request, shape: list[int]) -> bytes:
    """``r`` serialised (its migration count already one higher: the import is its next instance)."""
    blob = {
        "format": EXPORT_FORMAT,
        "rid": r.rid,
        "prompt_ids": list(r.prompt_ids),
        "output_ids": list(r.output_ids),
        "output_logprobs": list(r.output_logprobs),
        "params": r.params.to_json(),
        "return_logprob": r.return_logprob,
        "version": r.version,
        "migrations": r.migrations + 1,
        "rng_state": r.generator.get_state(),  # type: ignore[union-attr]  # (set at submit and import)
        "kv": r.kv.export_tensor() if r.kv is not None and r.kv.length else None,
        "model": shape,
        "routing": r.routing.export() if r.routing is not None else None,
        "draft_sources": [list(x) for x in r.draft_sources],
        "spec_acceptance": r.spec_acceptance.to_json(),
        "keep_kv": r.keep_kv,
    }
    buf = io.BytesIO()
    torch.save(blob, buf)
    return buf.getvalue()


def dump_kept(rid: str, e: KeptEntry, shape: list[int]) -> bytes:
    """A kept turn's KV (``e``) serialised for the trajectory's next turn on another instance."""
    buf = io.BytesIO()
    torch.save({"format": KV_EXPORT_FORMAT, "rid": rid, "tokens": e.tokens, "version": e.version,
                "kv": e.kv.export_tensor(), "model": shape}, buf)
    return buf.getvalue()


def load_export(data: bytes, fmt: str, what: str, shape: list[int]) -> dict[str, Any]:
    """An export's body (untrusted input) as a dict of format ``fmt`` for a model of ``shape``."""
    try:
        blob = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's fault
        raise ProtocolError(f"body is not an exported {what}: {str(exc)[:200]}") from None
    if not isinstance(blob, dict) or blob.get("format") != fmt:
        raise ProtocolError(f"body is not a {fmt} export")
    got = blob.get("model")
    if not isinstance(got, list) or got != shape:
        raise ProtocolError(f"exported {what} is for a different model shape {str(got)[:80]}")
    return blob


def kv_of(blob: dict[str, Any], kv_shape: KVShape, n_tokens: int) -> RequestKV | None:
    """An exported request's KV (None: it had none), checked against the request's ``n_tokens``."""
    kv = blob.get("kv")
    if kv is None:
        return None
    if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or kv.device.type != "cpu":
        raise ProtocolError("kv must be a dense CPU tensor")
    if not kv.is_floating_point():
        raise ProtocolError("kv must be a floating-point tensor")
    try:
        out = RequestKV.from_tensor(kv_shape, kv)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if out.length >= n_tokens:
        raise ProtocolError("exported KV covers more tokens than the request has")
    return out


def kept_of(blob: dict[str, Any], vocab: int, kv_shape: KVShape, max_context: int) -> tuple[list[int], RequestKV]:
    """An exported kept KV's tokens and KV, checked (its rid and version are checked by the caller first)."""
    tokens, kv = blob.get("tokens"), blob.get("kv")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                                           for t in tokens):
        raise ProtocolError(f"tokens must be a list of token ids in [0, {vocab})")
    if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or not kv.is_floating_point():
        raise ProtocolError("kv must be a dense floating-point tensor")
    try:
        req_kv = RequestKV.from_tensor(kv_shape, kv)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if req_kv.length != len(tokens) or not tokens or len(tokens) >= max_context:
        raise ProtocolError(f"the KV covers {req_kv.length} tokens, the export names {len(tokens)}")
    return tokens, req_kv


def request_from_blob(blob: dict[str, Any], on_done: DoneCallback | None, vocab: int, weight_version: str) -> Request:
    """Validate an export's fields (it is untrusted input) and build the request (on weights ``weight_version``)."""

    def ids(key: str, allow_empty: bool) -> list[int]:
        v = blob.get(key)
        if not isinstance(v, list) or not (v or allow_empty):
            raise ProtocolError(f"{key} must be a{'' if allow_empty else ' non-empty'} list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in v):
            raise ProtocolError(f"{key} must hold token ids in [0, {vocab})")
        return list(v)

    rid, version, lps = blob.get("rid"), blob.get("version"), blob.get("output_logprobs")
    if not isinstance(rid, str) or not rid:
        raise ProtocolError("rid must be a non-empty string")
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        raise ProtocolError("version must be a string or integer")
    output_ids = ids("output_ids", allow_empty=True)
    try:
        if not isinstance(lps, list) or len(lps) != len(output_ids) or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) for x in lps
        ):
            raise TypeError
        logprobs = [float(x) for x in lps]  # TypeError for non-numbers, OverflowError for huge ints
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError("output_logprobs must be a list of numbers, one per output id") from None
    migrations = blob.get("migrations")
    if isinstance(migrations, bool) or not isinstance(migrations, int) or migrations < 0:
        raise ProtocolError("migrations must be an integer >= 0")
    if not isinstance(blob.get("return_logprob"), bool):
        raise ProtocolError("return_logprob must be a boolean")
    gen = torch.Generator(device="cpu")
    try:
        gen.set_state(blob.get("rng_state"))
    except Exception as exc:  # noqa: BLE001 - TypeError, RuntimeError, ... all mean "not a state"
        raise ProtocolError(f"rng_state is not a CPU generator state: {str(exc)[:200]}") from None
    return Request(
        rid=rid,
        prompt_ids=ids("prompt_ids", allow_empty=False),
        params=SamplingParams.from_json(blob.get("params")),
        return_logprob=blob["return_logprob"],
        on_done=on_done,
        version=weight_version,
        required_version=str(version),
        output_ids=output_ids,
        output_logprobs=logprobs,
        generator=gen,
        migrations=migrations,
        draft_sources=_draft_sources_of(blob.get("draft_sources"), vocab),
        spec_acceptance=_spec_acceptance_of(blob.get("spec_acceptance")),
        keep_kv=blob.get("keep_kv") is True,
    )


def _spec_acceptance_of(raw: Any) -> DraftAcceptance:
    """An export's ``spec_acceptance`` (absent in exports of engines without the per-request
    policy: the request starts from the prior)."""
    if raw is None:
        return DraftAcceptance()
    try:
        return DraftAcceptance.from_json(raw)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


def _draft_sources_of(raw: Any, vocab: int) -> list[list[int]]:
    """An export's ``draft_sources`` (absent in exports of engines without speculation)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(
        isinstance(src, list) and all(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < vocab for t in src)
        for src in raw
    ):
        raise ProtocolError(f"draft_sources must be a list of lists of token ids in [0, {vocab})")
    return [list(src) for src in raw[-MAX_DRAFT_SOURCES:]]  # the bound submit keeps
