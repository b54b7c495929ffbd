"""SGLang-only calls on top of the shared :class:`~dora_megatron.rollout.client.EngineClient`.

WHY a subclass: the base client covers what SGLang and the embedded engine share; SGLang's
weight-update requests carry ``flush_cache`` / ``abort_all_requests`` (reference A.3) that the
pause choreography must set explicitly (pitfalls E.6-E.8), and its load numbers live in
``/v1/loads`` rather than in ``/get_server_info``. Every request here is plain SGLang protocol,
so the same calls work against the embedded engine (which ignores fields it does not need).
"""

from __future__ import annotations

from typing import Any, Sequence

from dora_megatron.rollout.client import EngineClient, EngineError


class SGLangClient(EngineClient):
    async def update_weights_from_distributed(  # type: ignore[override]
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group", weight_version: int | str | None = None,
        *, flush_cache: bool = True, abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """POST the metadata of one bucket; rank 0 broadcasts the tensors concurrently, in order."""
        body: dict[str, Any] = {
            "names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
            "flush_cache": bool(flush_cache), "abort_all_requests": bool(abort_all_requests),
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        out = await self._request("POST", "/update_weights_from_distributed", body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url + "/update_weights_from_distributed", 400, str(out.get("message")))
        return out

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,  # type: ignore[override]
                                       *, flush_cache: bool = True, abort_all_requests: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        out = await self._request("POST", "/update_weights_from_disk", body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url + "/update_weights_from_disk", 400, str(out.get("message")))
        return out

    async def loads(self) -> dict[str, float] | None:
        """Running requests and KV usage summed over DP ranks (``/v1/loads``); None if absent."""
        try:
            body = await self._request("GET", "/v1/loads?include=core")
        except EngineError as exc:
            if exc.status in (404, 405):
                return None
            raise
        return summarize_loads(body)

    async def health_generate(self) -> bool:
        try:
            await self._request("GET", "/health_generate")
        except Exception:  # noqa: BLE001 - any failure means not (yet) healthy
            return False
        return True


def summarize_loads(body: Any) -> dict[str, float] | None:
    """Sum ``num_running_reqs`` / ``num_waiting_reqs`` / token counts over every per-DP entry.

    The shape of ``/v1/loads`` has changed across 0.5.x (a list, or an object holding one), so
    every nested object that carries ``num_running_reqs`` counts as one DP rank."""
    entries: list[dict] = []

    def walk(x: Any) -> None:
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
    running = sum(int(e.get("num_running_reqs") or 0) for e in entries)
    waiting = sum(int(e.get("num_waiting_reqs") or 0) for e in entries)
    used = sum(float(e.get("num_used_tokens") or 0) for e in entries)
    total = sum(float(e.get("num_total_tokens") or 0) for e in entries)
    return {"num_running_reqs": running, "num_waiting_reqs": waiting,
            "kv_usage": used / total if total > 0 else 0.0}
