"""``wait_ready``, the one health poller of the launchers: its own session or a shared one (many
instances, a bounded number of checks on the wire), exits and timeouts told apart."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.rollout.health import InstanceNotReady, NotReadyInTime, shared_checks, wait_ready


class _Server:
    """Answers ``/health`` 503 for the first ``not_ready`` checks, then 200; records how many checks
    were in flight at once (each one is held ``hold_s``)."""

    def __init__(self, not_ready: int = 0, hold_s: float = 0.0) -> None:
        self.not_ready, self.hold_s = not_ready, hold_s
        self.checks = self.in_flight = self.most_in_flight = 0

    async def health(self, _req):
        self.checks += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.in_flight -= 1
        return web.Response(status=503 if self.checks <= self.not_ready else 200)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        return app


def test_own_session_polls_until_ready():
    srv = _Server(not_ready=2)

    async def go():
        async with TestServer(srv.app(), host="127.0.0.1") as server:
            return await wait_ready(str(server.make_url("")), timeout_s=30, interval_s=0.01)

    assert asyncio.run(go()) >= 0 and srv.checks == 3


def test_shared_session_bounds_checks_on_the_wire_and_stays_open():
    """The 4,096-instance start-up path: many waits, one session, at most ``max_in_flight`` checks at once."""
    srv = _Server(hold_s=0.05)

    async def go():
        async with TestServer(srv.app(), host="127.0.0.1") as server:
            url = str(server.make_url(""))
            async with shared_checks(max_in_flight=3) as checks:
                waited = await asyncio.gather(*(wait_ready(url, timeout_s=60, interval_s=0.01, session=checks,
                                                           what=f"engine{i}") for i in range(12)))
                still_open = not checks.session().closed
            return waited, still_open

    waited, still_open = asyncio.run(go())
    assert len(waited) == 12 and still_open
    assert srv.checks == 12 and srv.most_in_flight == 3  # bounded by the session, and the bound was reached


def test_timeout_is_a_timeout_error_naming_the_server():
    srv = _Server(not_ready=10 ** 6)

    async def go(what):
        async with TestServer(srv.app(), host="127.0.0.1") as server:
            async with shared_checks() as checks:
                await wait_ready(str(server.make_url("")).rstrip("/"), timeout_s=0.2, interval_s=0.02,
                                 session=checks, what=what, tail=lambda: "last log line")

    with pytest.raises(NotReadyInTime, match=r"(?s)^engine3 not healthy after 0 s \(http://127\.0\.0\.1:\d+/health\)"
                                             r"\nlast log line$") as exc:
        asyncio.run(go("engine3"))
    assert isinstance(exc.value, TimeoutError) and isinstance(exc.value, InstanceNotReady)
    with pytest.raises(NotReadyInTime, match=r"^http://127\.0\.0\.1:\d+/health not ready after 0 s"):
        asyncio.run(go(None))


def test_an_exit_ends_the_wait_and_alive_may_raise_its_own_error():
    class ChildGone(RuntimeError):
        pass

    def gone() -> bool:
        raise ChildGone("trainer exited with status 1")

    async def go(alive):
        # nothing listens there: only alive() can end the wait before the timeout
        async with shared_checks() as checks:
            await wait_ready("http://127.0.0.1:9", timeout_s=60, interval_s=0.01, alive=alive, session=checks)

    with pytest.raises(InstanceNotReady, match="process exited before it was ready"):
        asyncio.run(go(lambda: False))
    with pytest.raises(ChildGone, match="trainer exited"):
        asyncio.run(go(gone))
