"""SGLang-only calls on top of the shared :class:`~dora_megatron.comm.engine_client.EngineClient`.

WHY a subclass: the base client covers what SGLang and the embedded engine share; SGLang 0.5.23
differs from it on points that decide whether a weight update works at all (docs/sglang.md, "SGLang
0.5.23 conformance"; the file of SGLang 0.5.23 each point is read from is named):

* ``/update_weights_from_distributed`` answers 400 unless a weight-update session is open:
  ``POST /begin_weight_update {"selector"}`` first, ``POST /end_weight_update`` after
  (``srt/managers/scheduler_components/weight_updater.py``);
* every update request carries ``flush_cache`` / ``abort_all_requests`` (reference A.3), and an
  update from disk without ``load_format`` uses the *server's* load format (``dummy`` on a server
  started for pushed weights), so it is always sent (``srt/managers/tokenizer_manager.py``);
* loads and versions are read from ``/v1/loads`` and ``/model_info``, which the tokenizer process
  answers itself; ``/get_server_info`` goes to the scheduler (it blocks while weights load) and is
  deprecated, as is ``/get_model_info`` (``srt/entrypoints/http_server.py``);
* KV usage is ``token_usage`` (used / pool size); ``num_total_tokens`` is used + *waiting* tokens,
  not the pool size (``srt/managers/scheduler_components/load_inquirer.py``);
* ``/abort_request`` always answers 200 with an empty body, matched or not, and ``/flush_cache``
  answers plain text (``srt/entrypoints/http_server.py``);
* weight updates name the runners they load (``selector``): always ``target``. dora pushes the
  policy's weights, which are the target's; a draft runner (EAGLE, NEXTN) would be handed the same
  tensors under ``all`` (``weight_updater.py`` ``update_weights_from_distributed``: every runner of
  the selector loads the one receive) and an EAGLE3 draft maps ``model.layers.0.*`` onto its own
  layer (``models/llama_eagle3.py`` ``load_weights``). Without a draft, ``target`` and ``all`` are
  the same runners (``_select_runners``). ``/update_weights_from_disk`` has no selector in 0.5.23
  (docs/sglang.md, "Speculative decoding");
* SGLang has no dora extension; its weight checksum (``/weights_checker`` with ``action=checksum``)
  hashes SGLang's own per-GPU checksums, so it compares instances with each other, never with the
  trainer's checksum.
"""

from __future__ import annotations

import logging
from typing import Sequence

from dora_megatron.comm.engine_client import EngineClient, EngineError, ProbeUnavailable, probe_unavailable
from dora_megatron.comm.json_value import JSON, JSONObject, json_object
from dora_megatron.comm.protocol import ProtocolError

#: the SGLang release whose protocol this client speaks (and the gpu extra pins)
TESTED_SGLANG_VERSION = "0.5.23"

log = logging.getLogger(__name__)


class SGLangClient(EngineClient):
    #: the one warning about a missing /v1/loads was logged (see :meth:`server_info`)
    _loads_warned = False
    #: the runners every weight update loads (module doc): the target's, never a draft's
    weight_selector = "target"

    def _check(self, path: str, out: JSON) -> JSON:
        """``out``, or an :class:`EngineError` when it says ``success: false`` (SGLang answers some
        refusals with a 200 carrying that)."""
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url + path, 400, str(out.get("message")))
        return out

    def _checked_object(self, path: str, out: JSONObject) -> JSONObject:
        self._check(path, out)
        return out

    async def _probe(self, method: str, path: str, body: JSONObject | None = None) -> JSON:
        """An optional probe: a reply saying the server has no such route or action (a build or
        launch mode without it) raises :class:`ProbeUnavailable`; any other failure is raised as is."""
        try:
            return self._check(path, await self._request(method, path, body))
        except EngineError as exc:
            if probe_unavailable(exc) and not isinstance(exc, ProbeUnavailable):
                raise ProbeUnavailable(exc.url, exc.status, exc.message) from exc
            raise

    async def extensions(self) -> frozenset[str]:
        """SGLang offers no dora extension; asking the scheduler-bound ``/get_server_info`` would
        only risk a stall while weights load."""
        return frozenset()

    async def begin_weight_update(self) -> JSONObject:
        """Open the weight-update session every ``update_weights_from_distributed`` needs, on the
        runners of :attr:`weight_selector`."""
        return self._checked_object("/begin_weight_update",
                                    await self._object("POST", "/begin_weight_update", {"selector": self.weight_selector}))

    async def end_weight_update(self) -> JSONObject:
        """Close the session (also after a failed update: the next push cannot open one otherwise)."""
        return self._checked_object("/end_weight_update", await self._object("POST", "/end_weight_update", {}))

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group", weight_version: int | str | None = None,
        *, flush_cache: bool = True, abort_all_requests: bool = False,
    ) -> JSONObject:
        """POST the metadata of one bucket; rank 0 broadcasts the tensors concurrently, in order.
        ``weight_version``: only with the last bucket (SGLang sets it on every successful call)."""
        body: JSONObject = {
            "names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
            "flush_cache": bool(flush_cache), "abort_all_requests": bool(abort_all_requests),
            "selector": self.weight_selector,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        path = "/update_weights_from_distributed"
        return self._checked_object(path, await self._object("POST", path, body))

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       *, load_format: str = "auto", flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> JSONObject:
        """``load_format``: how ``model_path`` is read; sent always (see module doc)."""
        body: JSONObject = {"model_path": model_path, "load_format": load_format, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        path = "/update_weights_from_disk"
        return self._checked_object(path, await self._object("POST", path, body))

    async def model_info(self) -> JSONObject:
        """Raises :class:`ProbeUnavailable` on a server without ``/model_info``."""
        return json_object(await self._probe("GET", "/model_info"), self.base_url + "/model_info")

    async def weight_version(self) -> str:
        return str((await self.model_info()).get("weight_version"))

    async def loads(self) -> dict[str, float] | None:
        """Running/waiting requests and KV usage over every DP rank (``/v1/loads``); None if absent."""
        try:
            body = await self._probe("GET", "/v1/loads?include=core")
        except ProbeUnavailable:
            return None
        return summarize_loads(body)

    async def server_version(self) -> str | None:
        """The SGLang release serving (``/v1/loads`` carries ``version``), None if not reported
        (also when the server has no ``/v1/loads``)."""
        try:
            body = await self._probe("GET", "/v1/loads?include=core")
        except ProbeUnavailable:
            return None
        return str(body["version"]) if isinstance(body, dict) and body.get("version") else None

    async def server_info(self) -> JSONObject:
        """What the runtime polls: ``/v1/loads`` (not the scheduler-bound ``/get_server_info``).

        A server without ``/v1/loads`` (or without load entries in it) is not failed for it: its
        liveness is asked of ``/health`` instead (raises if that fails too) and the answer says
        ``loads_unavailable``, so the caller keeps its own count of the instance's requests. One
        warning per client."""
        loads = await self.loads()
        if loads is not None:
            return dict(loads)
        await self._call("GET", "/health")
        if not self._loads_warned:
            self._loads_warned = True
            log.warning("%s: no load report at /v1/loads; its running requests are not polled (liveness "
                        "from /health)", self.base_url)
        return {"loads_unavailable": True}

    async def instance_checksum(self) -> str:
        """SGLang's checksum of the weights it serves (``/weights_checker``, ``action=checksum``):
        equal on two instances holding the same weights with the same layout. Raises
        :class:`ProbeUnavailable` where the server has no ``/weights_checker`` or no checksum action."""
        out = await self._probe("POST", "/weights_checker", {"action": "checksum"})
        checksum = out.get("per_engine_checksum") if isinstance(out, dict) else None
        if not checksum:
            raise EngineError(self.base_url + "/weights_checker", 200, f"no per_engine_checksum in {str(out)[:200]}")
        return str(checksum)

    async def health_generate(self) -> bool:
        try:
            await self._call("GET", "/health_generate")
        except Exception:  # noqa: BLE001 - any failure means not (yet) healthy
            return False
        return True


def summarize_loads(body: JSON) -> dict[str, float] | None:
    """Sum ``num_running_reqs`` / ``num_waiting_reqs`` over every per-DP entry; KV usage is the
    used share of the summed pools (``num_used_tokens`` / ``max_total_num_tokens``), or the mean
    ``token_usage`` when a pool size is missing.

    The shape of ``/v1/loads`` has changed across 0.5.x (a list, or an object holding one), so
    every nested object that carries ``num_running_reqs`` counts as one DP rank. Never
    ``num_total_tokens``: it is used + waiting tokens (load_inquirer.py), about the used count
    itself when nothing waits, which read as a pool size gives a usage of about 1.0."""
    entries: list[JSONObject] = []

    def walk(x: JSON) -> None:
        if isinstance(x, dict):
            if "num_running_reqs" in x:
                entries.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(body)
    if not entries:
        return None
    running = sum(int(_number(e, "num_running_reqs")) for e in entries)
    waiting = sum(int(_number(e, "num_waiting_reqs")) for e in entries)
    used = sum(_number(e, "num_used_tokens") for e in entries)
    pool = [_number(e, "max_total_num_tokens") for e in entries]
    if all(p > 0 for p in pool):
        kv = used / sum(pool)
    else:
        kv = sum(_number(e, "token_usage") for e in entries) / len(entries)
    return {"num_running_reqs": running, "num_waiting_reqs": waiting, "kv_usage": kv}


def _number(entry: JSONObject, key: str) -> float:
    """``entry[key]`` as a number; 0 when absent or null. A value that is no number (or a numeric
    string) raises a :class:`~dora_megatron.comm.protocol.ProtocolError` naming the field."""
    value = entry.get(key)
    if not value:
        return 0.0
    if isinstance(value, (int, float, str)):
        try:
            return float(value)
        except ValueError:
            pass
    raise ProtocolError(f"/v1/loads: {key} must be a number, got {str(value)[:80]}")
