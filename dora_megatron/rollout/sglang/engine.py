"""The runtime's view of an SGLang instance: the protocol SGLang really offers, nothing more.

WHY an adapter: SGLang has no request export/import and no per-request version check, and its
abort matches rids by prefix (reference A.5, A.6). This adapter

* exposes only the dora extensions it is told to (none by default), so the runtime takes the
  SGLang paths: migration = abort + resubmit of prompt + partial output on a same-version
  instance (counted as re-prefill), weight switches without a checksum call;
* checks C1 after the fact: every ``/generate`` answer echoes ``meta_info.weight_version`` and,
  since 0.5.22, ``meta_info.weight_versions`` (which version produced which output tokens);
  :func:`~dora_megatron.rollout.versions.span_problem` (the rule shared with vLLM, case
  ``updates_in_flight=True``) refuses one whose first tokens come from another version than the
  routed one (:class:`~dora_megatron.comm.engine_client.VersionMismatch`, the runtime's C1 guard); one
  that started on the routed version and crossed an update (``retract``/``in_place`` pauses) is
  returned with its spans, and the runtime records every version in it;
* makes rids prefix-free on the wire (``<rid>#``), so aborting ``s1`` never aborts ``s10``;
* reads running requests and KV usage from ``/v1/loads`` and the version from ``/model_info``
  (both answered without the scheduler, which ``/get_server_info`` waits for while weights load);
* compares weights across instances with SGLang's own checksum (``/weights_checker``), the only
  one SGLang has: it is not the trainer's checksum, so the runtime checks that every instance on
  a version reports the same one.

Wrapping the embedded engine's client in this adapter gives exactly the SGLang behaviour, which is
how the CPU integration tests exercise the production path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Iterable, Sequence

from dora_megatron.comm.engine_client import EngineClient, EngineError, ExtensionUnsupported, VersionMismatch
from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.rollout.versions import span_problem

log = logging.getLogger(__name__)

RID_END = "#"
#: SGLang's answer (``weight_updater.py``) when an update loaded the weights but its cache flush was refused
NOT_FLUSHED = "the cache was not flushed"
#: how long a refused post-update flush is retried: the request the scheduler still counted is one
#: whose answer already went out, so it leaves within a scheduler step or two
FLUSH_RETRY_S = 30.0


def wire_rid(rid: str) -> str:
    """The rid sent to SGLang: no wire rid is a prefix of another (sample ids never contain ``#``)."""
    if RID_END in rid:
        raise ValueError(f"rid {rid!r} contains {RID_END!r}")
    return rid + RID_END


class SGLangEngine:
    """Implements the runtime's ``Engine`` protocol on an SGLang server."""

    def __init__(self, client: EngineClient | str, *, expose: Iterable[str] = (), timeout_s: float = 600.0,
                 checksum: bool = True) -> None:
        """``checksum``: compare instances with ``/weights_checker``; off where instances holding the
        same weights lay them out differently (EPLB moves experts per instance)."""
        self.client = SGLangClient(client, timeout_s=timeout_s) if isinstance(client, str) else client
        self.expose = frozenset(expose)
        self.checksum = checksum
        self.version_mismatches = 0

    @property
    def base_url(self) -> str:
        return self.client.base_url

    async def close(self) -> None:
        await self.client.close()

    async def supports(self, name: str) -> bool:
        return name in self.expose and await self.client.supports(name)

    async def generate(self, input_ids: Sequence[int], sampling_params=None, *, rid: str | None = None,
                       return_logprob: bool = True, version: int | str | None = None, routed_experts: bool = False):
        server_checks = version is not None and await self.supports("dora_version")
        resp = await self.client.generate(input_ids, sampling_params, rid=None if rid is None else wire_rid(rid),
                                          return_logprob=return_logprob, version=version if server_checks else None,
                                          routed_experts=routed_experts)
        if version is not None:
            # SGLang may switch weights under running requests (retract/in_place): the first span decides
            spans = resp.weight_versions or [(resp.weight_version, 0, len(resp.output_ids))]
            problem = span_problem(spans, len(resp.output_ids), str(version), updates_in_flight=True)
            if problem is not None:
                self.version_mismatches += 1
                raise VersionMismatch(self.base_url + "/generate", 409,
                                      f"request {rid} routed for weight version {version}: {problem}")
        return dataclasses.replace(resp, rid=rid) if rid is not None else resp

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        return await self.client.abort(wire_rid(rid) if rid else "", abort_all)

    async def server_info(self) -> dict[str, Any]:
        """Running requests and KV usage (``/v1/loads`` on an :class:`SGLangClient`)."""
        return dict(await self.client.server_info())

    async def continue_generation(self) -> dict[str, Any]:
        return await self.client.continue_generation()

    async def instance_checksum(self) -> str | None:
        """SGLang's own weights checksum (comparable between instances only); None without one."""
        if self.checksum and isinstance(self.client, SGLangClient):
            return await self.client.instance_checksum()
        return None

    async def weight_version(self) -> str:
        return await self.client.weight_version()

    async def update_weights_from_disk(self, model_path: str, weight_version=None) -> dict[str, Any]:
        """Switch to a snapshot; the runtime calls this only once the instance is empty, so the
        update neither waits for nor aborts anything.

        Its post-update cache flush can still be refused: real SGLang 0.5.23 counts a request as
        running for a moment after its ``/generate`` answered (seen in a 200-step CPU run: every
        answer in, then ``Cache not flushed ... #running-req: 1`` at the update, a 400, and the
        instance restarted as failed). The weights are then loaded and the version set; only the
        flush is missing, so it is retried until the scheduler is idle (at most
        :data:`FLUSH_RETRY_S`), and no request reuses KV that the old weights computed."""
        try:
            return await self.client.update_weights_from_disk(model_path, weight_version=weight_version)
        except EngineError as exc:
            if exc.status != 400 or NOT_FLUSHED not in exc.message:
                raise
            refused = exc
        loop = asyncio.get_running_loop()
        deadline, tries = loop.time() + FLUSH_RETRY_S, 0
        while loop.time() < deadline:
            await asyncio.sleep(0.05)
            tries += 1
            if await self.client.flush_cache():
                log.info("%s: weights %s loaded; the cache flush after it was refused, flushed on try %d",
                         self.base_url, weight_version, tries)
                return {"success": True, "message": f"weights loaded; cache flushed on try {tries}"}
        raise refused

    async def export_request(self, rid: str) -> bytes:
        if not await self.supports("export_request"):
            raise ExtensionUnsupported(f"{self.base_url}: SGLang has no request export")
        return await self.client.export_request(rid)

    async def import_request(self, blob: bytes):
        if not await self.supports("import_request"):
            raise ExtensionUnsupported(f"{self.base_url}: SGLang has no request import")
        return await self.client.import_request(blob)

    async def weights_checksum(self) -> str:
        if not await self.supports("weights_checksum"):
            raise ExtensionUnsupported(f"{self.base_url}: SGLang has no weights checksum")
        return await self.client.weights_checksum()
