"""The migration export format of the embedded engine: a request (state, KV, RNG state) and a
kept turn's KV, serialised by one instance and read back (as untrusted input) by another.

WHY a module of its own: the format is a contract between two instances (and across versions of
this code), with its own validation; the scheduler (:mod:`.scheduler`) only removes a request
before :func:`dump_request` and queues the one :func:`request_from_blob` builds.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from msgspec import Meta

from dora_megatron.comm.protocol import Label, ProtocolError, SamplingParams, decode_fields
from dora_megatron.models.hf_config import ModelSpec
from dora_megatron.rollout.engine.kept_kv import KeptEntry
from dora_megatron.rollout.engine.kv_cache import KVShape, RequestKV
from dora_megatron.rollout.engine.request import DoneCallback, Request
from dora_megatron.rollout.engine.speculator import MAX_DRAFT_SOURCES
from dora_megatron.rollout.speculation import DraftAcceptance

EXPORT_FORMAT = "dora-request-v1"
KV_EXPORT_FORMAT = "dora-kept-kv-v1"


#: a token id as an export carries it (below the vocabulary: :func:`_in_vocab`, the bound is the model's)
TokenId = Annotated[int, Meta(ge=0)]


@dataclass
class _RequestFields:
    """The plain fields of a request export, typed: msgspec checks an import against them (the
    tensors, the sampling parameters and the routing are checked by their own readers)."""

    rid: Annotated[str, Meta(min_length=1)]
    version: Label
    prompt_ids: Annotated[list[TokenId], Meta(min_length=1)]
    output_ids: list[TokenId]
    output_logprobs: list[float]
    migrations: Annotated[int, Meta(ge=0)]
    return_logprob: bool
    draft_sources: list[list[TokenId]] = field(default_factory=list)  # absent: an engine without speculation


_REQUEST_KEYS = tuple(f.name for f in dataclasses.fields(_RequestFields))


@dataclass
class _KeptFields:
    """The plain fields of a kept KV's export (:func:`dump_kept`), typed."""

    rid: Annotated[str, Meta(min_length=1)]
    version: str
    tokens: Annotated[list[TokenId], Meta(min_length=1)]


def _in_vocab(ids: list[int], vocab: int, key: str) -> None:
    """A :class:`ProtocolError` naming the first of ``ids`` (at ``key``) that is no token id of a
    ``vocab``-token model (msgspec checked each is an int >= 0; the bound is the model's)."""
    if ids and max(ids) >= vocab:
        i = next(i for i, t in enumerate(ids) if t >= vocab)
        raise ProtocolError(f"{key}[{i}] must be a token id < {vocab}, got {ids[i]}")


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


def kept_fields(blob: dict[str, Any]) -> _KeptFields:
    """An exported kept KV's rid, version and tokens, their types checked (before the version is
    compared with the instance's)."""
    return decode_fields(_KeptFields, blob, ("rid", "version", "tokens"))


def kept_of(blob: dict[str, Any], fields: _KeptFields, vocab: int, kv_shape: KVShape,
            max_context: int) -> tuple[list[int], RequestKV]:
    """An exported kept KV's tokens (``fields``: :func:`kept_fields`) and KV, checked."""
    tokens, kv = fields.tokens, blob.get("kv")
    _in_vocab(tokens, vocab, "tokens")
    if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or not kv.is_floating_point():
        raise ProtocolError("kv must be a dense floating-point tensor")
    try:
        req_kv = RequestKV.from_tensor(kv_shape, kv)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if req_kv.length != len(tokens) or len(tokens) >= max_context:
        raise ProtocolError(f"the KV covers {req_kv.length} tokens, the export names {len(tokens)}")
    return tokens, req_kv


def request_from_blob(blob: dict[str, Any], on_done: DoneCallback | None, vocab: int, weight_version: str) -> Request:
    """Validate an export's fields (it is untrusted input: the types by msgspec, :class:`_RequestFields`;
    then the vocabulary bound and the lengths) and build the request (on weights ``weight_version``)."""
    f = decode_fields(_RequestFields, blob, _REQUEST_KEYS)
    for key, ids in (("prompt_ids", f.prompt_ids), ("output_ids", f.output_ids),
                     *((f"draft_sources[{i}]", src) for i, src in enumerate(f.draft_sources))):
        _in_vocab(ids, vocab, key)
    if len(f.output_logprobs) != len(f.output_ids):
        raise ProtocolError(f"output_logprobs has {len(f.output_logprobs)} entries for {len(f.output_ids)} output_ids")
    gen = torch.Generator(device="cpu")
    try:
        gen.set_state(blob.get("rng_state"))
    except Exception as exc:  # noqa: BLE001 - TypeError, RuntimeError, ... all mean "not a state"
        raise ProtocolError(f"rng_state is not a CPU generator state: {str(exc)[:200]}") from None
    return Request(
        rid=f.rid,
        prompt_ids=f.prompt_ids,
        params=SamplingParams.from_json(blob.get("params")),
        return_logprob=f.return_logprob,
        on_done=on_done,
        version=weight_version,
        required_version=str(f.version),
        output_ids=f.output_ids,
        output_logprobs=f.output_logprobs,
        generator=gen,
        migrations=f.migrations,
        draft_sources=f.draft_sources[-MAX_DRAFT_SOURCES:],  # the bound submit keeps
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
