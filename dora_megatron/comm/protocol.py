"""Typed requests/responses of the SGLang HTTP protocol subset we use, plus our extensions.

Why: the embedded server validates untrusted JSON and the client builds requests; both use
these dataclasses so field names and defaults live in one place. Their field types (with
``msgspec.Meta`` bounds) are the wire schema: :func:`decode_fields` has msgspec check a body
against them (strictly: no bool for an int, no string for a number; a list such as ``input_ids``
checked and copied in one pass) and turns its error into a :class:`ProtocolError` carrying the HTTP
status and a message that names the offending field and value (:func:`field_message`:
``input_ids[3] must be an integer, got 'x'``). The rules a type cannot say (a range across fields,
a host name) are checked after it.

SGLang fields implemented (see reference A.3-A.4): ``/generate`` ``input_ids``, ``rid``,
``sampling_params`` {``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``,
``ignore_eos``, ``sampling_seed``}, ``return_logprob``; response ``output_ids`` and ``meta_info``.
Our extensions: ``dora_version`` (the weight version the request must run on; 409 otherwise) and
``dora_draft_sources`` (token id lists, prompt + output, of the request's finished group siblings:
the embedded engine drafts speculative tokens from them under ``rollout.speculative: group``) and
``dora_keep_kv`` (the request's KV stays on the instance when it finishes, for its trajectory's
next turn).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from array import array
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Mapping, TypeVar

import msgspec
from msgspec import Meta

DEFAULT_MAX_NEW_TOKENS = 128
# Temperatures below this are greedy (as SGLang): dividing logits by a smaller one overflows.
SAMPLING_EPS = 1e-6
# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class ProtocolError(Exception):
    """A bad request; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _obj(body: Any, what: str) -> dict[str, Any]:
    """``body`` if it is a JSON object (msgspec checks it: the values are not walked)."""
    try:
        return msgspec.convert(body, dict[str, Any], strict=True)
    except msgspec.ValidationError:
        raise ProtocolError(f"{what}: request body must be a JSON object, got {type(body).__name__}") from None


def _short(v: Any) -> str:
    """repr of an untrusted value, cut so that error messages stay small."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


#: a finite float: msgspec's bounds refuse inf and nan (any other float passes them)
Finite = Annotated[float, Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]
_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string", "str | null": "a string",
          "int | str": "a string or an integer", "array": "a list", "object": "a JSON object"}
_ERROR = re.compile(r"^(?:Expected `(?P<kind>[^`]+)`(?P<rest>.*?)|(?P<other>.*?))(?: - at `\$(?P<where>[^`]*)`)?$")
_T = TypeVar("_T")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")
#: a weight version label: clients send a string or an integer (the label is its str())
Label = int | str


def _at(body: Any, where: str) -> Any:
    """The value at msgspec's path ``where`` (``.key`` and ``[i]`` steps) of ``body``."""
    for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", where):
        body = body[key] if key else body[int(index)]
    return body


def field_message(exc: msgspec.ValidationError, value: Any, path: str = "", what: str = "body") -> str:
    """msgspec's error about ``value`` (found at ``path`` of a body) as a message naming the field
    (``path`` + msgspec's path inside ``value``, ``samples[3].reward``) and the offending value
    (``must be an integer, got 'x'``); ``what`` names the whole body when there is no field. A
    value inside a JSON object's values (msgspec's ``[...]``: it does not say which key) is shown
    with the object it is in.

    WHY here: every wire decoder (the engine's requests and answers, the trainer's ``/train`` and
    ``/push_weights``) words its errors the same way."""
    m = _ERROR.match(str(exc))
    inner = (m["where"] or "") if m else ""
    where = (path + inner) if path else inner.lstrip(".")
    missing = _MISSING.match(m["other"] or "") if m else None
    if missing:
        return f"missing field {where + '.' if where else ''}{missing[1]}"
    if m is None:
        return f"{where or what}: {exc}"
    where = where or what  # the whole value is wrong: named as the body
    known, unknown, _ = inner.partition("[...]")
    got = f"in {_short(_at(value, known))}" if unknown else f"got {_short(_at(value, inner))}"
    rest = (m["rest"] or "").strip()
    if m["kind"] == "float" and rest.startswith((">=", "<=")) or m["other"] == "Number out of range":
        return f"{where} must be a finite number, {got}"
    if rest.startswith((">=", "<=", ">", "<")):
        return f"{where} must be {rest}, {got}"
    if m["kind"] is not None:
        kind = m["kind"]
        said = _KINDS.get(kind) or _KINDS.get(kind.removesuffix(" | null"), kind)
        bound = "" if not rest or rest.startswith(",") else " " + rest  # "of length >= 1", not ", got `str`"
        return f"{where} must be {said}{bound}, {got}"
    return f"{where}: {m['other']}, {got}"


def _error(exc: msgspec.ValidationError, value: Any, path: str, what: str) -> ProtocolError:
    """:func:`field_message` as a 400 :class:`ProtocolError`."""
    return ProtocolError(field_message(exc, value, path, what))


def decode_fields(cls: type[_T], body: Mapping[str, Any], keys: tuple[str, ...], path: str = "", **given: Any) -> _T:
    """``cls`` (a dataclass) from the ``keys`` of ``body``, checked by msgspec against its field
    types; a null or absent key takes the field's default (as SGLang's request models do), ``given``
    are fields taken as they are instead (checked too). A wrong value raises :class:`ProtocolError`
    naming ``path`` + the field and the value."""
    fields = {**{k: body[k] for k in keys if body.get(k) is not None}, **given}
    try:
        return msgspec.convert(fields, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise _error(exc, fields, path.rstrip("."), cls.__name__) from None


def _label(body: Mapping[str, Any], key: str) -> str | None:
    """The weight version label at ``key`` of ``body`` (a string or an integer, checked by msgspec),
    as a string; None when absent or null."""
    v = body.get(key)
    if v is None:
        return None
    try:
        return str(msgspec.convert(v, Label, strict=True))
    except msgspec.ValidationError as exc:
        raise _error(exc, v, key, key) from None


def check_host(address: str) -> str:
    """``address`` as it goes into a ``tcp://`` URL: an IP literal or a syntactically valid host name.

    Why: the address is spliced into a rendezvous URL and resolved by torch; rejecting garbage
    here answers 400 at once instead of a resolver or connect timeout (or URL injection).
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not _HOSTNAME.match(address):
            raise ProtocolError(f"master_address {_short(address)} is not an IP address or host name") from None
        return address
    return f"[{ip}]" if ip.version == 6 else str(ip)


@dataclass
class SamplingParams:
    max_new_tokens: Annotated[int, Meta(ge=0)] = DEFAULT_MAX_NEW_TOKENS
    temperature: Finite = 1.0
    top_p: Finite = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None  # SEED_MIN..SEED_MAX (checked in from_json: msgspec bounds stop at int64)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_json(cls, d: Any) -> "SamplingParams":
        if d is None:
            return cls()
        d = _obj(d, "sampling_params")
        p = "sampling_params."
        sp = decode_fields(cls, d, _SAMPLING_KEYS, p)
        if sp.sampling_seed is not None and not SEED_MIN <= sp.sampling_seed <= SEED_MAX:
            raise ProtocolError(f"{p}sampling_seed must be >= {SEED_MIN} and <= {SEED_MAX}, "
                                f"got {_short(sp.sampling_seed)}")
        if sp.temperature < 0:
            raise ProtocolError(f"{p}temperature must be >= 0, got {sp.temperature}")
        if not 0.0 < sp.top_p <= 1.0:
            raise ProtocolError(f"{p}top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k == 0 or sp.top_k < -1:
            raise ProtocolError(f"{p}top_k must be -1 (disabled) or >= 1, got {sp.top_k}")
        return sp

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["sampling_seed"] is None:
            del d["sampling_seed"]
        return d


_SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = False
    dora_version: str | None = None
    #: routing replay (SGLang 0.5.23 names): reply meta_info.routed_experts for positions [start_len, seqlen-1)
    return_routed_experts: bool = False
    routed_experts_start_len: Annotated[int, Meta(ge=0)] = 0
    dora_draft_sources: list[list[int]] = field(default_factory=list)
    dora_keep_kv: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "GenerateRequest":
        body = _obj(body, "/generate")
        if "input_ids" not in body:
            raise ProtocolError("missing field input_ids (this engine takes token ids, not text)")
        ids = body["input_ids"]
        # WHY a look at the first entry: SGLang's batched form deserves its own word, not "must be an integer"
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise ProtocolError("batched input_ids (list of lists) are not supported; send one request per prompt")
        if body.get("stream"):
            raise ProtocolError("stream=true is not supported by the embedded engine")
        # input_ids (up to tens of thousands of ids) and the draft sources are checked and copied by
        # msgspec in one pass: an int each, never a bool or a float
        r = decode_fields(cls, body, ("rid", "return_logprob", "return_routed_experts", "routed_experts_start_len",
                                "dora_draft_sources", "dora_keep_kv"),
                    input_ids=ids, dora_version=_label(body, "dora_version"))
        if not r.input_ids:
            raise ProtocolError("input_ids must not be empty")
        return dataclasses.replace(r, sampling_params=SamplingParams.from_json(body.get("sampling_params")))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "input_ids": list(self.input_ids),
            "sampling_params": self.sampling_params.to_json(),
            "return_logprob": self.return_logprob,
        }
        if self.rid is not None:
            d["rid"] = self.rid
        if self.dora_version is not None:
            d["dora_version"] = self.dora_version
        if self.return_routed_experts:
            d["return_routed_experts"] = True
            d["routed_experts_start_len"] = self.routed_experts_start_len
        if self.dora_draft_sources:
            d["dora_draft_sources"] = [list(src) for src in self.dora_draft_sources]
        if self.dora_keep_kv:
            d["dora_keep_kv"] = True
        return d


def finish_stop(matched: int) -> dict[str, Any]:
    return {"type": "stop", "matched": int(matched)}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": int(length)}


def finish_abort(message: str = "Abort", status_code: int = 200, err_type: str | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclass
class GenerateResponse:
    """The parsed ``/generate`` answer (SGLang's shape)."""

    rid: str
    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    output_token_logprobs: list[float] | None = None
    migrated: bool = False
    #: ``meta_info.weight_versions`` (SGLang >= 0.5.22): ``(version, start, end)`` output-token spans,
    #: in order, saying which weights produced which tokens; empty when the engine does not report them
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    #: the output as the controller's sample store holds it, ``(array("i") ids, array("f") log-probs)``,
    #: built by :func:`~dora_megatron.comm.generate_codec.parse_generate` (in its worker thread for a
    #: big answer). WHY: appending an array to the store's arrays on the event loop is a copy of
    #: bytes; appending the lists converted every token there (at reasoning lengths thousands per
    #: answer, thousands of answers per step). None: not parsed by it (the store converts the lists).
    token_arrays: tuple[array[int], array[float]] | None = field(default=None, repr=False, compare=False)

    @property
    def versions_used(self) -> list[str]:
        """The weight versions that produced this answer's tokens, in order (at least the echoed one)."""
        spans = [v for v, _, _ in self.weight_versions]
        return spans or [self.weight_version]

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type"))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GenerateResponse":
        meta = d.get("meta_info") or {}
        lps = meta.get("output_token_logprobs")
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=list(d.get("output_ids") or []),
            finish_reason=dict(meta.get("finish_reason") or {}),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", 0)),
            weight_version=str(meta.get("weight_version", "")),
            output_token_logprobs=None if lps is None else [float(x[0]) for x in lps],
            migrated=bool(meta.get("dora_migrated", False)),
            weight_versions=_spans(meta.get("weight_versions")),
            raw=dict(d),
        )


@dataclass
class _Span:
    """One entry of ``meta_info.weight_versions`` (SGLang's ``{"version", "start", "end"}``)."""

    version: Label
    start: int = 0
    end: int = 0


def _spans(raw: Any) -> list[tuple[str, int, int]]:
    """``meta_info.weight_versions`` as ``(version, start, end)``, checked by msgspec.

    WHY an error, not a skipped entry: the spans say which weights sampled the answer, and the
    runtime refuses an answer by them; a span it cannot read must not vanish from that check."""
    if raw is None:
        return []
    try:
        spans = msgspec.convert(raw, list[_Span], strict=True)
    except msgspec.ValidationError as exc:
        raise _error(exc, raw, "meta_info.weight_versions", "meta_info.weight_versions") from None
    return [(str(s.version), s.start, s.end) for s in spans]


@dataclass
class AbortRequest:
    rid: str = ""
    abort_all: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "AbortRequest":
        body = _obj(body, "/abort_request")
        r = decode_fields(cls, body, ("rid", "abort_all"))
        if not r.rid and not r.abort_all:
            raise ProtocolError("give rid (non-empty) or abort_all=true")
        return r


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class PauseRequest:
    mode: str = "abort"

    @classmethod
    def from_json(cls, body: Any) -> "PauseRequest":
        body = _obj(body or {}, "/pause_generation")
        r = decode_fields(cls, body, ("mode",))
        if r.mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {PAUSE_MODES}, got {r.mode!r}")
        return r


@dataclass
class UpdateFromDiskRequest:
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "UpdateFromDiskRequest":
        body = _obj(body, "/update_weights_from_disk")
        if body.get("model_path") in (None, ""):
            raise ProtocolError("missing field model_path")
        return decode_fields(cls, body, ("model_path", "abort_all_requests"), weight_version=_label(body, "weight_version"))


MAX_WORLD_SIZE = 1 << 16  # far above any real weight-update group; keeps ranks in C++ int range


@dataclass
class InitGroupRequest:
    master_address: str
    master_port: Annotated[int, Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE - 1)]
    world_size: Annotated[int, Meta(ge=2, le=MAX_WORLD_SIZE)]
    group_name: str = "weight_update_group"
    backend: str = "gloo"

    @classmethod
    def from_json(cls, body: Any) -> "InitGroupRequest":
        body = _obj(body, "/init_weights_update_group")
        for k in ("master_address", "master_port", "rank_offset", "world_size"):
            if k not in body:
                raise ProtocolError(f"missing field {k}")
            if body[k] is None:
                raise ProtocolError(f"{k} must not be null")
        r = decode_fields(cls, body, ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"))
        check_host(r.master_address)
        if r.rank_offset >= r.world_size:
            raise ProtocolError(f"rank_offset {r.rank_offset} must be < world_size {r.world_size}")
        if r.backend not in ("gloo", "nccl"):
            raise ProtocolError(f"backend must be gloo or nccl, got {r.backend!r}")
        return r


@dataclass
class DestroyGroupRequest:
    group_name: str = "weight_update_group"

    @classmethod
    def from_json(cls, body: Any) -> "DestroyGroupRequest":
        body = _obj(body, "/destroy_weights_update_group")
        return decode_fields(cls, body, ("group_name",))


@dataclass
class UpdateFromDistributedRequest:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Meta(ge=0)]]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "UpdateFromDistributedRequest":
        body = _obj(body, "/update_weights_from_distributed")
        for k in ("names", "dtypes", "shapes"):
            if k not in body:
                raise ProtocolError(f"missing field {k}")
        r = decode_fields(cls, body, ("names", "dtypes", "shapes", "group_name", "abort_all_requests"),
                    weight_version=_label(body, "weight_version"))
        if not (len(r.names) == len(r.dtypes) == len(r.shapes)):
            raise ProtocolError(f"names, dtypes, shapes differ in length ({len(r.names)}, {len(r.dtypes)}, "
                                f"{len(r.shapes)})")
        return r


@dataclass
class DraftSourcesRequest:
    """``POST /dora/draft_sources``: token id lists that a running request may draft from."""

    rid: str
    sources: list[list[int]]

    @classmethod
    def from_json(cls, body: Any) -> "DraftSourcesRequest":
        body = _obj(body, "/dora/draft_sources")
        if body.get("rid") in (None, ""):
            raise ProtocolError("missing field rid")
        sources = body.get("sources")
        return decode_fields(cls, body, ("rid",), sources=[] if sources is None else sources)


@dataclass
class ExportRequest:
    """The body of ``/dora/export_request``, ``/dora/export_kv`` and ``/dora/release_kv``: a rid."""

    rid: str

    @classmethod
    def from_json(cls, body: Any) -> "ExportRequest":
        body = _obj(body, "/dora/export_request")
        if body.get("rid") in (None, ""):
            raise ProtocolError("missing field rid")
        return decode_fields(cls, body, ("rid",))
