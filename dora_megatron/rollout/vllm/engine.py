"""The runtime's view of a vLLM instance: the runtime's ``Engine`` protocol on vLLM's own API.

WHY an adapter (as for SGLang): vLLM has none of the ``/dora/*`` extensions, so this adapter
offers none (``supports`` is always False) and the runtime takes its fallbacks: migration = abort +
resubmit of prompt + partial output on a same-version instance (re-prefill, counted), routing by
version in the controller, switches without a checksum call. What it adds:

* **The version guard (C1).** vLLM labels every output token with the weight version that sampled
  it (``weight_versions`` spans); :func:`~dora_megatron.rollout.versions.span_problem` (the rule
  shared with SGLang, case ``updates_in_flight=False``) refuses an answer not wholly from the routed
  version with :class:`~dora_megatron.comm.engine_client.VersionMismatch`: the runtime then counts none
  of its tokens and runs the sample again (C1 stays exact even if a reload raced a request).
* **Request ids.** Each submission gets its own wire id ``<rid>@<n>`` (vLLM rejects nothing, but a
  resubmitted sample must never be confused with its aborted predecessor), and abort goes to the
  server's id ``generate-tokens-<wire id>`` (a raw id is silently ignored). vLLM's abort reply
  always says ``aborted: 1``, so whether a request was still running is known from the adapter's
  own table of in-flight submissions; the partial output comes back through the pending generate
  (``finish_reason: abort``), which is what the runtime waits for.
* **Version switches.** :meth:`update_weights_from_disk` reloads in place (pause, ``reload_weights``
  from the snapshot, relabel, reset the prefix cache, resume) or, when constructed with a
  ``restart`` callable (MoE on CPU, see :mod:`.switch`), restarts the process on the snapshot and
  relabels it. While restarting, :meth:`server_info` answers from the adapter (an empty instance)
  so the runtime's stats poll does not mistake the planned restart for a failure.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable, Mapping, Sequence

from dora_megatron.comm.engine_client import EngineError, ExtensionUnsupported, VersionMismatch
from dora_megatron.comm.protocol import GenerateResponse, SamplingParams
from dora_megatron.rollout.versions import Span, span_problem
from dora_megatron.rollout.vllm.client import VLLMClient, server_request_id

log = logging.getLogger(__name__)

WIRE_SEP = "@"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}

Restart = Callable[[str], Awaitable[None]]  # model_path -> the instance serves it (healthy)

#: how long a resume waits for the reply to the pause before it (see :meth:`VLLMEngine._resume_after`):
#: a ``wait`` pause answers once the instance has no request left, which is at once on an instance
#: the runtime emptied before switching it, and within one generation otherwise
PAUSE_REPLY_WAIT_S = 60.0


def vllm_sampling_params(sp: SamplingParams | Mapping[str, Any] | None, return_logprob: bool = True) -> dict[str, Any]:
    """The runtime's (SGLang-named) sampling parameters in vLLM's names.

    ``logprobs: 0`` asks for the sampled token's log-prob only; ``detokenize: false`` because the
    server runs without a tokenizer (token ids in, token ids out)."""
    p = sp if isinstance(sp, SamplingParams) else SamplingParams.from_json(sp)
    out: dict[str, Any] = {
        "max_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else 0, "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos, "detokenize": False,
    }
    if p.sampling_seed is not None:
        out["seed"] = int(p.sampling_seed) & 0x7FFFFFFFFFFFFFFF
    if return_logprob:
        out["logprobs"] = 0
    return out


def parse_generate(body: Mapping[str, Any], rid: str, prompt_len: int) -> tuple[GenerateResponse, list[Span]]:
    """vLLM's generate answer as the runtime's :class:`GenerateResponse`, with its spans
    (``(version, start, end)``; a span without bounds gets -1, which the guard refuses)."""
    choices = body.get("choices") or []
    if not choices:
        raise EngineError("/inference/v1/generate", 502, f"answer without choices: {str(body)[:200]}")
    c = choices[0]
    ids = [int(t) for t in (c.get("token_ids") or [])]
    content = (c.get("logprobs") or {}).get("content")
    lps = None if content is None else [float(x["logprob"]) for x in content]
    if lps is not None and len(lps) != len(ids):
        raise EngineError("/inference/v1/generate", 502, f"{len(lps)} logprobs for {len(ids)} tokens")
    reason = str(c.get("finish_reason") or "stop")
    finish: dict[str, Any] = {"type": _FINISH.get(reason, reason)}
    if reason == "stop" and c.get("stop_reason") is not None:
        finish["matched"] = c["stop_reason"]
    if reason == "length":
        finish["length"] = len(ids)
    spans = [(str(s.get("version")), int(s.get("start", -1)), int(s.get("end", -1)))
             for s in (c.get("weight_versions") or [])]
    labels = sorted({s[0] for s in spans})
    resp = GenerateResponse(rid=rid, output_ids=ids, finish_reason=finish, prompt_tokens=prompt_len,
                            completion_tokens=len(ids), weight_version=labels[0] if len(labels) == 1 else ",".join(labels),
                            output_token_logprobs=lps, raw=dict(body))
    return resp, spans


def parse_kv_usage(metrics_text: str) -> float | None:
    """``vllm:kv_cache_usage_perc`` (a fraction in [0, 1]) from the Prometheus text, if present."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
    return None


class VLLMEngine:
    """Implements the runtime's ``Engine`` protocol on a vLLM server.

    ``initial_version``: the version of the weights the process was started on; it is written as
    the server's weight label before the first request (vLLM starts labelled ``default``)."""

    def __init__(self, client: VLLMClient | str, *, initial_version: int | str | None = 0,
                 restart: Restart | None = None, timeout_s: float = 600.0,
                 pause_reply_wait_s: float = PAUSE_REPLY_WAIT_S) -> None:
        self.client = VLLMClient(client, timeout_s=timeout_s) if isinstance(client, str) else client
        self.restart = restart
        self.pause_reply_wait_s = pause_reply_wait_s
        self._label = None if initial_version is None else str(initial_version)
        self._labelled = initial_version is None
        self._label_lock = asyncio.Lock()
        self._inflight: dict[str, str] = {}  # rid -> wire id of its running submission
        self._ids = itertools.count()
        self._switching = False
        self.version_mismatches = 0
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return self.client.base_url

    @property
    def switch_by_restart(self) -> bool:
        return self.restart is not None

    async def close(self) -> None:
        await self.client.close()

    async def supports(self, name: str) -> bool:
        return False  # no /dora/* extensions: the runtime uses its SGLang-style fallbacks

    async def _ensure_label(self) -> None:
        if self._labelled:
            return
        async with self._label_lock:
            if not self._labelled:
                await self.client.update_weight_version(self._label)
                self._labelled = True

    async def generate(self, input_ids: Sequence[int], sampling_params=None, *, rid: str | None = None,
                       return_logprob: bool = True, version: int | str | None = None,
                       routed_experts: bool = False) -> GenerateResponse:
        if routed_experts:  # vLLM's generate reply carries no routed experts to replay
            raise ExtensionUnsupported(f"{self.base_url}: routed experts (routing replay) are not available from vLLM")
        await self._ensure_label()
        rid = rid if rid is not None else f"r{next(self._ids)}"
        if WIRE_SEP in rid:
            raise ValueError(f"rid {rid!r} contains {WIRE_SEP!r}")
        wire = f"{rid}{WIRE_SEP}{next(self._ids)}"
        self._inflight[rid] = wire
        try:
            body = await self.client.generate(wire, input_ids, vllm_sampling_params(sampling_params, return_logprob))
        finally:
            if self._inflight.get(rid) == wire:
                del self._inflight[rid]
        resp, spans = parse_generate(body, rid, len(input_ids))
        if version is not None:
            # vLLM versions switch only on an empty instance: every span must be the routed version
            problem = span_problem(spans, len(resp.output_ids), str(version), updates_in_flight=False)
            if problem is not None:
                self.version_mismatches += 1
                raise VersionMismatch(self.base_url + "/inference/v1/generate", 409,
                                      f"request {rid} routed for weight version {version}: {problem}")
        return resp

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort ``rid`` (or everything); False when it is not running here (finished, or not yet sent)."""
        if abort_all:
            await self.client.abort_requests([])
            return bool(self._inflight)
        wire = self._inflight.get(rid)
        if wire is None:
            return False
        await self.client.abort_requests([server_request_id(wire)])
        return True

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"num_running_reqs": len(self._inflight), "kv_usage": 0.0,
                                "weight_version": self._label, "dora_extensions": []}
        if self._switching:
            return info  # a planned restart/reload: not a failure
        try:
            text = await self.client.metrics()
        except Exception:  # noqa: BLE001 - a restart that began while we asked is not a failure
            if self._switching:
                return info
            raise
        kv = parse_kv_usage(text)
        if kv is not None:
            info["kv_usage"] = kv
        return info

    async def weight_version(self) -> str:
        return await self.client.weight_version()

    async def update_weights_from_disk(self, model_path: str, weight_version=None) -> dict[str, Any]:
        """Switch to the snapshot at ``model_path`` (the runtime calls this on an empty instance)."""
        label = str(weight_version) if weight_version is not None else self._label
        self._switching = True
        try:
            if self.restart is not None:
                await self.restart(str(model_path))
                self.restarts += 1
            else:
                # a task of its own: a cancel (the run's end) that lands while the pause is on the
                # wire does not withdraw it from the server, which may apply it after a resume sent
                # at once; so the resume waits for the pause's reply (:meth:`_resume_after`)
                pause = asyncio.ensure_future(self.client.pause("wait"))
                try:
                    await asyncio.shield(pause)
                    await self.client.reload_weights(str(model_path))
                    await self.client.reset_prefix_cache()
                finally:
                    await self._resume_after(pause)
            if label is not None:
                await self.client.update_weight_version(label)
            self._label, self._labelled = label, True
        finally:
            self._switching = False
        return {"success": True, "weight_version": label, "restarted": self.restart is not None}

    async def _resume_after(self, pause: "asyncio.Future[Any]") -> None:
        """Resume the server once it has answered ``pause`` (waiting at most ``pause_reply_wait_s``).

        WHY wait: vLLM applies a pause when its request reaches the engine and a resume when its
        own does; they travel on different connections. A resume sent while the pause is still
        on its way can be applied first, and the pause that lands after it leaves the server
        paused: every later request on it then waits until its timeout (the vLLM tier's
        reference requests hung so). The pause's reply proves it was applied (``wait`` answers
        once the instance is drained; a cancelled run has aborted its requests by then)."""
        try:
            if not pause.done():
                try:
                    await asyncio.wait_for(asyncio.shield(pause), timeout=self.pause_reply_wait_s)
                except asyncio.TimeoutError:
                    log.warning("%s: no answer to the pause within %g s; resuming anyway", self.base_url,
                                self.pause_reply_wait_s)
                except Exception as err:  # noqa: BLE001 - the pause failed: resume all the same
                    log.warning("%s: the pause failed (%s); resuming anyway", self.base_url, err)
            elif not pause.cancelled():
                pause.exception()  # retrieved (it was raised to the caller already, or is None)
        finally:  # a second cancel while waiting must not skip the resume either
            await self.client.resume()

    async def export_request(self, rid: str) -> bytes:
        raise ExtensionUnsupported(f"{self.base_url}: vLLM has no request export")

    async def import_request(self, blob: bytes):
        raise ExtensionUnsupported(f"{self.base_url}: vLLM has no request import")

    async def weights_checksum(self) -> str:
        raise ExtensionUnsupported(f"{self.base_url}: vLLM's weight checksums are not the trainer's "
                                   "(CPU-repacked linear weights hash to the empty digest)")
