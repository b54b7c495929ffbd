"""Typed requests/responses of the SGLang HTTP protocol subset we use, plus our extensions.

Why: the embedded server validates untrusted JSON and the client builds requests; both use
these dataclasses so field names and defaults live in one place. Parsing raises
:class:`ProtocolError` carrying the HTTP status and a message that names the offending field.
Only the standard library is imported.

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

import ipaddress
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

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


def _obj(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ProtocolError(f"{what}: request body must be a JSON object, got {type(body).__name__}")
    return body


def _short(v: Any) -> str:
    """repr of an untrusted value, cut so that error messages stay small."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _int(
    d: Mapping[str, Any], key: str, default: Any, *, ge: int | None = None, le: int | None = None, path: str = ""
) -> Any:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{path}{key} must be an integer, got {_short(v)}")
    if ge is not None and v < ge:
        raise ProtocolError(f"{path}{key} must be >= {ge}, got {_short(v)}")
    if le is not None and v > le:
        raise ProtocolError(f"{path}{key} must be <= {le}, got {_short(v)}")
    return v


def _float(d: Mapping[str, Any], key: str, default: float, *, path: str = "") -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{path}{key} must be a number, got {_short(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer too large for a float
        f = math.inf
    if not math.isfinite(f):
        raise ProtocolError(f"{path}{key} must be a finite number, got {_short(v)}")
    return f


def _bool(d: Mapping[str, Any], key: str, default: bool, *, path: str = "") -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{path}{key} must be a boolean, got {_short(v)}")
    return v


def _str(d: Mapping[str, Any], key: str, default: Any, *, path: str = "") -> Any:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise ProtocolError(f"{path}{key} must be a string, got {_short(v)}")
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ProtocolError(f"{name} must be a list of integers")
    return list(v)


def _version(d: Mapping[str, Any], key: str) -> str | None:
    """A weight version label: a string or an integer (sent as either by clients)."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ProtocolError(f"{key} must be a string or integer, got {_short(v)}")
    return str(v)


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
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_json(cls, d: Any) -> "SamplingParams":
        if d is None:
            return cls()
        d = _obj(d, "sampling_params")
        p = "sampling_params."
        sp = cls(
            max_new_tokens=_int(d, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, ge=0, path=p),
            temperature=_float(d, "temperature", 1.0, path=p),
            top_p=_float(d, "top_p", 1.0, path=p),
            top_k=_int(d, "top_k", -1, path=p),
            stop_token_ids=_int_list(d.get("stop_token_ids") or [], p + "stop_token_ids"),
            ignore_eos=_bool(d, "ignore_eos", False, path=p),
            sampling_seed=_int(d, "sampling_seed", None, ge=SEED_MIN, le=SEED_MAX, path=p),
        )
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


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = False
    dora_version: str | None = None
    #: routing replay (SGLang 0.5.23 names): reply meta_info.routed_experts for positions [start_len, seqlen-1)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    dora_draft_sources: list[list[int]] = field(default_factory=list)
    dora_keep_kv: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "GenerateRequest":
        body = _obj(body, "/generate")
        if "input_ids" not in body:
            raise ProtocolError("missing field input_ids (this engine takes token ids, not text)")
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise ProtocolError("batched input_ids (list of lists) are not supported; send one request per prompt")
        ids = _int_list(ids, "input_ids")
        if not ids:
            raise ProtocolError("input_ids must not be empty")
        if body.get("stream"):
            raise ProtocolError("stream=true is not supported by the embedded engine")
        version = _version(body, "dora_version")
        sources = _draft_sources(body, "dora_draft_sources")
        return cls(
            input_ids=ids,
            sampling_params=SamplingParams.from_json(body.get("sampling_params")),
            rid=_str(body, "rid", None),
            return_logprob=_bool(body, "return_logprob", False),
            dora_version=version,
            return_routed_experts=_bool(body, "return_routed_experts", False),
            routed_experts_start_len=_int(body, "routed_experts_start_len", 0, ge=0),
            dora_draft_sources=sources,
            dora_keep_kv=_bool(body, "dora_keep_kv", False),
        )

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


def _spans(raw: Any) -> list[tuple[str, int, int]]:
    """``meta_info.weight_versions`` as ``(version, start, end)``; malformed entries are skipped."""
    out: list[tuple[str, int, int]] = []
    for span in raw or ():
        if isinstance(span, Mapping) and "version" in span:
            out.append((str(span["version"]), int(span.get("start", 0)), int(span.get("end", 0))))
    return out


@dataclass
class AbortRequest:
    rid: str = ""
    abort_all: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "AbortRequest":
        body = _obj(body, "/abort_request")
        r = cls(rid=_str(body, "rid", ""), abort_all=_bool(body, "abort_all", False))
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
        mode = _str(body, "mode", "abort")
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        return cls(mode=mode)


@dataclass
class UpdateFromDiskRequest:
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "UpdateFromDiskRequest":
        body = _obj(body, "/update_weights_from_disk")
        path = _str(body, "model_path", None)
        if not path:
            raise ProtocolError("missing field model_path")
        return cls(path, _version(body, "weight_version"), _bool(body, "abort_all_requests", False))


MAX_WORLD_SIZE = 1 << 16  # far above any real weight-update group; keeps ranks in C++ int range


@dataclass
class InitGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"

    @classmethod
    def from_json(cls, body: Any) -> "InitGroupRequest":
        body = _obj(body, "/init_weights_update_group")
        for k in ("master_address", "master_port", "rank_offset", "world_size"):
            if k not in body:
                raise ProtocolError(f"missing field {k}")
        r = cls(
            master_address=_str(body, "master_address", ""),
            master_port=_int(body, "master_port", 0, ge=1, le=65535),
            rank_offset=_int(body, "rank_offset", 1, ge=1, le=MAX_WORLD_SIZE - 1),
            world_size=_int(body, "world_size", 2, ge=2, le=MAX_WORLD_SIZE),
            group_name=_str(body, "group_name", "weight_update_group"),
            backend=_str(body, "backend", "gloo"),
        )
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
        return cls(_str(body, "group_name", "weight_update_group"))


@dataclass
class UpdateFromDistributedRequest:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False

    @classmethod
    def from_json(cls, body: Any) -> "UpdateFromDistributedRequest":
        body = _obj(body, "/update_weights_from_distributed")
        for k in ("names", "dtypes", "shapes"):
            if k not in body:
                raise ProtocolError(f"missing field {k}")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("names must be a list of strings")
        if not isinstance(dtypes, list) or not all(isinstance(n, str) for n in dtypes):
            raise ProtocolError("dtypes must be a list of strings")
        if not isinstance(shapes, list):
            raise ProtocolError("shapes must be a list of lists of integers")
        shapes = [_int_list(s, f"shapes[{i}]") for i, s in enumerate(shapes)]
        for i, s in enumerate(shapes):
            if any(x < 0 for x in s):
                raise ProtocolError(f"shapes[{i}] has a negative dimension: {_short(s)}")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ProtocolError(f"names, dtypes, shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        return cls(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=_str(body, "group_name", "weight_update_group"),
            weight_version=_version(body, "weight_version"),
            abort_all_requests=_bool(body, "abort_all_requests", False),
        )


@dataclass
class DraftSourcesRequest:
    """``POST /dora/draft_sources``: token id lists that a running request may draft from."""

    rid: str
    sources: list[list[int]]

    @classmethod
    def from_json(cls, body: Any) -> "DraftSourcesRequest":
        body = _obj(body, "/dora/draft_sources")
        rid = _str(body, "rid", None)
        if not rid:
            raise ProtocolError("missing field rid")
        return cls(rid, _draft_sources(body, "sources"))


def _draft_sources(body: Mapping[str, Any], key: str) -> list[list[int]]:
    sources = body.get(key) or []
    if not isinstance(sources, list):
        raise ProtocolError(f"{key} must be a list of lists of integers")
    return [_int_list(src, f"{key}[{i}]") for i, src in enumerate(sources)]


@dataclass
class ExportRequest:
    """The body of ``/dora/export_request``, ``/dora/export_kv`` and ``/dora/release_kv``: a rid."""

    rid: str

    @classmethod
    def from_json(cls, body: Any) -> "ExportRequest":
        body = _obj(body, "/dora/export_request")
        rid = _str(body, "rid", None)
        if not rid:
            raise ProtocolError("missing field rid")
        return cls(rid)
