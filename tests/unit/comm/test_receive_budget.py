"""The bytes of big answers a process reads at once (``comm/receive_budget.py``): granted in arrival
order, given back on every path, and what an :class:`EngineClient` holds through its
:class:`AnswerReader` while it reads and decodes real answers off a socket."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from dora_megatron.comm.answer_reader import AnswerReader
from dora_megatron.comm.engine_client import EngineClient
from dora_megatron.comm.receive_budget import ReceiveBudget


def test_a_big_waiter_is_not_passed_by_later_small_ones():
    async def main() -> list[str]:
        budget, order = ReceiveBudget(10), []
        first = await budget.acquire(6)

        async def take(name: str, size: int) -> None:
            n = await budget.acquire(size)
            order.append(name)
            budget.release(n)

        big = asyncio.create_task(take("big", 8))  # does not fit beside the 6 held
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 1))  # would fit, but arrived after the big one
        await asyncio.sleep(0)
        assert order == [] and budget.waited == 2
        budget.release(first)
        await asyncio.gather(big, small)
        assert budget.used == 0
        return order

    assert asyncio.run(main()) == ["big", "small"]


def test_an_answer_larger_than_the_budget_takes_all_of_it():
    async def main() -> tuple[int, int]:
        budget = ReceiveBudget(10)
        n = await budget.acquire(50)
        used = budget.used
        budget.release(n)
        return n, used

    assert asyncio.run(main()) == (10, 10)


async def _full_then_waiting(*sizes: int) -> tuple[ReceiveBudget, int, list[asyncio.Task[int]]]:
    """A budget of 10 wholly granted, and a waiting call for each of ``sizes``, in that order."""
    budget = ReceiveBudget(10)
    held = await budget.acquire(10)
    waiters = [asyncio.create_task(budget.acquire(n)) for n in sizes]
    await asyncio.sleep(0)
    return budget, held, waiters


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_one_through():
    async def main() -> int:
        budget, held, (gone, nxt) = await _full_then_waiting(5, 10)
        gone.cancel()
        await asyncio.sleep(0)
        budget.release(held)
        granted = await nxt
        assert budget.used == 10
        budget.release(granted)
        return budget.used

    assert asyncio.run(main()) == 0


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ReceiveBudget(0)


def _answer(n: int) -> bytes:
    return json.dumps({"output_ids": [7] * n, "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": n},
        "output_token_logprobs": [[-0.25, 7, None]] * n}}).encode()


async def _serve(handler, method: str = "POST", path: str = "/generate") -> tuple[web.AppRunner, str]:
    """``handler`` served on 127.0.0.1: its runner and its base URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_a_client_holds_at_most_the_budget_of_answers_and_gives_it_all_back():
    """Eight answers of ~150 KB at once through clients sharing a 400 KB budget: every answer comes
    back whole, at most the budget was ever held, some had to wait, and nothing stays held."""
    body = _answer(8_000)
    reader = AnswerReader(400_000)
    budget = reader.budget
    peak = [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        for i in range(0, len(body), 16_384):
            peak[0] = max(peak[0], budget.used)
            await resp.write(body[i:i + 16_384])
            await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    async def main() -> list[int]:
        runner, url = await _serve(handler)
        try:
            clients = [EngineClient(url, timeout_s=30, reader=reader) for _ in range(8)]
            got = await asyncio.gather(*(c.generate([1], {"max_new_tokens": 8}) for c in clients))
            for c in clients:
                await c.close()
        finally:
            await runner.cleanup()
            reader.close()
        return [len(r.output_ids) for r in got]

    assert len(body) > 100_000
    assert asyncio.run(main()) == [8_000] * 8
    assert budget.used == 0
    assert budget.waited > 0  # the bound was reached: answers waited in the server's sockets
    assert len(body) <= peak[0] <= budget.max_bytes


def test_an_answer_cut_off_mid_body_gives_its_bytes_back():
    """The server dies half-way through an answer: the call fails and its grant is returned."""
    body = _answer(8_000)
    reader = AnswerReader(1_000_000)
    budget = reader.budget

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[:20_000])
        request.transport.close()  # the engine dies mid-answer
        return resp

    async def main() -> BaseException | None:
        runner, url = await _serve(handler)
        try:
            async with EngineClient(url, timeout_s=30, reader=reader) as client:
                try:
                    await client.generate([1], {"max_new_tokens": 8})
                except Exception as exc:  # noqa: BLE001 - whichever error aiohttp raises for a cut body
                    return exc
        finally:
            await runner.cleanup()
            reader.close()
        return None

    err = asyncio.run(main())
    assert err is not None  # the fault happened
    assert budget.used == 0 and budget.waited == 0


def test_a_cancelled_head_of_the_line_does_not_hold_up_the_next_caller():
    """The first waiter gives up (its request was aborted) while the budget is full; once the
    budget is free, a new caller is granted at once, not queued behind the one that left."""
    async def main() -> int:
        budget, held, (gone,) = await _full_then_waiting(10)
        gone.cancel()
        await asyncio.sleep(0)
        budget.release(held)
        return await asyncio.wait_for(budget.acquire(4), timeout=5)

    assert asyncio.run(main()) == 4


def test_a_release_between_a_cancel_and_the_cancelled_task_resuming_skips_it():
    """A waiter is cancelled and, before its task runs again, a release comes: the release must
    pass over it (granting it would fail on a cancelled future) and grant the next in line."""
    async def main() -> tuple[int, int]:
        budget, held, (gone, nxt) = await _full_then_waiting(10, 3)
        gone.cancel()
        budget.release(held)  # same loop turn: gone's task has not yet seen its cancellation
        got = await nxt
        with pytest.raises(asyncio.CancelledError):
            await gone
        return got, budget.used

    assert asyncio.run(main()) == (3, 3)


def test_thousands_of_generate_connections_get_small_receive_buffers_a_few_keep_autotuning():
    from dora_megatron.comm.limits import KERNEL_RECEIVE_BYTES, MIN_RECEIVE_BUFFER, plan_connections

    few = plan_connections(4, 8, 100_000)
    paper = plan_connections(64, 64, 100_000)
    huge = plan_connections(4096, 8, 1_000_000)
    assert few.receive_buffer is None  # a few connections: the kernel's autotuning, as before
    assert paper.receive_buffer is not None
    # what the kernel charges (twice the size set) stays within the bytes they share
    assert 2 * paper.receive_buffer * paper.instances * paper.generate <= KERNEL_RECEIVE_BYTES
    assert huge.receive_buffer == MIN_RECEIVE_BUFFER  # never a window too small to move an answer
    assert MIN_RECEIVE_BUFFER <= paper.receive_buffer


def test_a_session_with_a_receive_buffer_connects_with_it():
    """The socket the session connects with has the buffer asked for (Linux reports twice the
    bytes set, its bookkeeping included), below what autotuning gives a socket left alone, and
    aiohttp buffers no more of an unread answer than that."""
    import socket

    from dora_megatron.comm.http_session import HttpSession

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # a body still arriving: the connection is the response's
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"x" * 65_536)
        await resp.write_eof()
        return resp

    async def rcvbuf(session: HttpSession, url: str) -> tuple[int, int]:
        async with session.session().get(url) as resp:
            sock = resp.connection.transport.get_extra_info("socket")
            size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            unread = resp.content.get_read_buffer_limits()[1]  # aiohttp stops reading above this
            await resp.read()
        await session.close()
        return size, unread

    async def main() -> tuple[tuple[int, int], tuple[int, int]]:
        runner, base = await _serve(handler, "GET", "/x")
        url = base + "/x"
        try:
            return await rcvbuf(HttpSession(5, receive_buffer=32 << 10), url), await rcvbuf(HttpSession(5), url)
        finally:
            await runner.cleanup()

    (small, unread), (default, default_unread) = asyncio.run(main())
    assert small == 2 * (32 << 10)
    assert default != small
    assert unread <= 32 << 10 < default_unread  # an answer left unread holds at most the buffer here


class _TimedReader(AnswerReader):
    """An answer reader that records how long each grant of its budget took (seconds)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.waits: list[float] = []

    async def acquire(self, size: int) -> int:
        t0 = time.monotonic()
        granted = await super().acquire(size)
        self.waits.append(time.monotonic() - t0)
        return granted


def test_a_wait_for_the_budget_is_not_part_of_the_calls_timeout(monkeypatch):
    """Two big answers, a budget smaller than one: the first holds all of it while its decode takes
    three times the clients' ``timeout_s``, and the second, whose engine answered at once, waits that
    long for it and still succeeds: the timeout bounds the engine's work, not this process's wait."""
    import dora_megatron.comm.generate_codec as codec

    timeout_s, body = 0.5, _answer(8_000)
    reader = _TimedReader(10_000)
    real, decodes = codec.parse_generate, []

    def slow_first(raw: bytes):
        decodes.append(raw)
        if len(decodes) == 1:
            time.sleep(3 * timeout_s)  # on the decoder thread, the budget held
        return real(raw)

    monkeypatch.setattr(codec, "parse_generate", slow_first)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def main() -> list[int]:
        runner, url = await _serve(handler)
        clients = [EngineClient(url, timeout_s=timeout_s, reader=reader) for _ in range(2)]
        try:
            first = asyncio.create_task(clients[0].generate([1], {"max_new_tokens": 8}))
            while not decodes:  # the first answer is read and decoding: the budget is all its
                await asyncio.sleep(0.01)
            second = await asyncio.wait_for(clients[1].generate([1], {"max_new_tokens": 8}), 30)
            return [len(r.output_ids) for r in (await first, second)]
        finally:
            for c in clients:
                await c.close()
            await runner.cleanup()
            reader.close()

    assert asyncio.run(main()) == [8_000, 8_000]
    assert reader.budget.waited == 1 and reader.budget.used == 0
    assert max(reader.waits) > 2 * timeout_s  # the second waited well past its timeout


async def _stalling(before_headers: float, before_rest: float, *, timeout_s: float,
                    reader: AnswerReader) -> tuple[BaseException | None, float]:
    """A generate against an engine that waits ``before_headers`` s to answer, sends the first 20 KB
    of a ~150 KB body, and waits ``before_rest`` s before the rest: the call's error (None: it
    succeeded) and how long it took."""
    body, stop = _answer(8_000), asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            await asyncio.wait_for(stop.wait(), before_headers)
            return web.Response(status=503)  # the test is over
        except asyncio.TimeoutError:
            pass
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[:20_000])
        try:
            await asyncio.wait_for(stop.wait(), before_rest)
            return resp  # the test is over: the body stays cut
        except asyncio.TimeoutError:
            pass
        await resp.write(body[20_000:])
        await resp.write_eof()
        return resp

    runner, url = await _serve(handler)
    t0 = time.monotonic()
    try:
        async with EngineClient(url, timeout_s=timeout_s, reader=reader) as client:
            # the outer bound only turns a call that never times out into a failure, not a hang
            await asyncio.wait_for(client.generate([1], {"max_new_tokens": 8}), 20)
        return None, time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the test looks at which error it is
        return exc, time.monotonic() - t0
    finally:
        stop.set()
        await runner.cleanup()
        reader.close()


@pytest.mark.parametrize("stall", ["headers", "body"])
def test_an_engine_that_stalls_still_times_out(stall: str):
    """Headers that never come, or a body that stops mid-way after its bytes were granted: the call
    raises TimeoutError after about ``timeout_s`` (not the test's outer bound), holding nothing."""
    reader = AnswerReader(1_000_000)
    before = (60.0, 0.0) if stall == "headers" else (0.0, 60.0)
    err, took = asyncio.run(_stalling(*before, timeout_s=0.5, reader=reader))
    assert isinstance(err, asyncio.TimeoutError), repr(err)
    assert 0.5 <= took < 10
    assert reader.budget.used == 0
    assert reader.budget.waited == 0


def test_the_headers_and_the_body_share_one_timeout():
    """The time to the headers and the time to read the body add up against one ``timeout_s``: each
    under it, together over it, the call times out (the bound is not restarted after the grant)."""
    reader = AnswerReader(1_000_000)
    err, took = asyncio.run(_stalling(0.35, 0.35, timeout_s=0.5, reader=reader))
    assert isinstance(err, asyncio.TimeoutError), repr(err)
    assert reader.budget.used == 0


def test_a_small_answer_is_never_held_back_by_the_budget():
    """An answer of at most BIG_ANSWER_BYTES is decoded on the loop: the reader lets it through at
    once, counting nothing, even while its budget is all granted."""
    from dora_megatron.comm.generate_codec import BIG_ANSWER_BYTES

    async def main() -> tuple[int, int, int]:
        reader = AnswerReader(BIG_ANSWER_BYTES + 1)
        held = await reader.acquire(10 * BIG_ANSWER_BYTES)  # all of it
        small = await asyncio.wait_for(reader.acquire(BIG_ANSWER_BYTES), 5)
        reader.release(small)
        used = reader.budget.used
        reader.release(held)
        reader.close()
        return small, used, reader.budget.waited

    assert asyncio.run(main()) == (0, BIG_ANSWER_BYTES + 1, 0)


@pytest.mark.parametrize("owner", ["controller", "client worker"])
def test_a_process_clients_share_one_answer_reader_closed_by_its_owner(owner: str, tmp_path):
    """The controller's clients (``EngineClients``) and a client worker's each share the one reader
    their owner made, and the owner's close stops its decoder thread: no big answer is decoded after."""
    from dora_megatron.config.schema import load_config

    cfg = load_config(None, [])
    urls = ("http://127.0.0.1:9", "http://127.0.0.1:10")
    big = _answer(2_000)

    async def main() -> tuple[bool, int, BaseException | None]:
        if owner == "controller":
            from dora_megatron.controller.clients import EngineClients

            clients = EngineClients(cfg, tmp_path, tmp_path, None, len(urls), lambda _msg: None)
            engines = {u: clients.make(u) for u in urls}
            reader, close = clients.reader, lambda: clients.close(engines)
        else:
            from dora_megatron.rollout.shard_worker import Worker

            worker = Worker(out=None)  # nothing is sent here
            worker.handle(("init", cfg, str(tmp_path), None))
            for h, u in enumerate(urls):
                worker.handle(("add", h, u))
            engines, reader, close = worker.engines, worker.reader, worker.close
        shared = all(e.reader is reader for e in engines.values())
        decoded = len((await reader.decode(big)).output_ids)
        await close()
        try:
            await reader.decode(big)
        except RuntimeError as exc:  # the executor refuses new work after its shutdown
            return shared, decoded, exc
        return shared, decoded, None

    shared, decoded, after_close = asyncio.run(main())
    assert shared and decoded == 2_000
    assert isinstance(after_close, RuntimeError) and "shutdown" in str(after_close)
