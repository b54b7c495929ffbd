"""Group siblings as speculative drafts (``rollout.speculative: group``).

WHY: the responses of one group answer the same prompt with the same weights, so a finished
sibling's tokens are good drafts for the ones still running, which are the group's long tail. A
request gets the siblings finished when it is submitted (``dora_draft_sources`` of its
``/generate``), and each sibling that finishes later is pushed to the running ones
(``/dora/draft_sources``). Drafts only speed decoding up: a lost push changes no token, so pushes
are best effort and their failures are logged, never raised.

Pushes never compete with the requests they are meant to speed up: :class:`DraftPushes` keeps at
most one push on the wire per instance (its own connection in the pool's plan, see
:func:`dora_megatron.controller.clients.connection_plan`) and merges the sources waiting for one
running request into one call. A call per finished sibling and running request would queue in the
instance's connection pool, and the generates and stats polls after them would wait behind them
(each push waits for the engine's step boundary).

Pushes also wait while their instance runs more requests than ``rollout.spec_max_batch``: the
engine does not speculate there, so a push would cost its call and deliver nothing it could use
yet. The sources wait (merged) until the instance's load drops to the bound, which each finish
on the instance (:meth:`DraftPushes.finished`) and the stats sweep (:meth:`DraftPushes.release_ready`)
check, and are dropped when their request finishes. Measured
on the main job: the pushes, not the drafting, were what ``group`` cost
(docs/results/speculation.md).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Coroutine, Iterable, Mapping

from dora_megatron.controller.records import Engine, SampleRecord

log = logging.getLogger(__name__)


def finished_sources(rec: SampleRecord, siblings: Iterable[SampleRecord | None]) -> list[list[int]]:
    """Prompt + output of the finished ones among ``rec``'s ``siblings`` (``rec`` itself skipped)."""
    return [[*rec.prompt_ids, *s.response_ids] for s in siblings if s is not None and s is not rec and s.finished]


def running_targets(rec: SampleRecord, siblings: Iterable[SampleRecord | None]) -> list[tuple[str, str]]:
    """``(instance, sample_id)`` of the siblings of ``rec`` still generating somewhere."""
    return [(s.gen_instance, s.sample_id) for s in siblings
            if s is not None and s is not rec and not s.finished and s.gen_instance is not None]


#: sources kept waiting per running request (the engine keeps no more than its own bound either)
MAX_PENDING_SOURCES = 8


class DraftPushes:
    """The finished siblings' sources on their way to the running ones: per instance, the sources
    waiting per request (merged, oldest dropped beyond :data:`MAX_PENDING_SOURCES`) and at most one
    push task sending them, one call per request."""

    def __init__(self, engines: Mapping[str, Engine], spawn: Callable[[Coroutine[Any, Any, None], str], object],
                 may_push: Callable[[str], bool] = lambda instance: True) -> None:
        self.engines = engines
        self.spawn = spawn
        self.may_push = may_push  # whether an instance may speculate now (its load is at most the bound)
        self.pending: dict[str, dict[str, list[list[int]]]] = {}  # instance -> sample id -> sources
        self.sending: set[str] = set()  # instances with a push task
        self.calls = 0  # pushes sent (one per request and turn of its instance's task)
        self.taken = 0  # sources a running request took
        self.merged = 0  # sources that rode in a call with others for the same request

    def offer(self, targets: list[tuple[str, str]], source: list[int]) -> None:
        """Queue ``source`` for each running sibling ``(instance, sample_id)`` in ``targets``."""
        for instance, sample_id in targets:
            waiting = self.pending.setdefault(instance, {}).setdefault(sample_id, [])
            waiting.append(source)
            del waiting[:-MAX_PENDING_SOURCES]
            self._start(instance)

    def _start(self, instance: str, check_now: bool = True) -> None:
        """A push task for ``instance`` if sources wait there and none runs; ``check_now``: only if
        :attr:`may_push` says so now (else the task asks when it runs, and ends at once if not)."""
        if instance not in self.sending and self.pending.get(instance) and (not check_now or self.may_push(instance)):
            self.sending.add(instance)
            self.spawn(self._send(instance), f"drafts-{instance}")

    def release_ready(self) -> None:
        """Start the pushes held for instances whose load has dropped to the bound (once per stats sweep)."""
        for instance in list(self.pending):
            if instance not in self.engines and instance not in self.sending:
                del self.pending[instance]  # left the pool: its requests run elsewhere now
            else:
                self._start(instance)

    def finished(self, instance: str | None, sample_id: str) -> None:
        """``sample_id`` finished on ``instance``: drop what waits for it, and look at the pushes
        held for the instance's other requests once this loop turn is over. WHY then: the
        orchestrator counts the finish (and places any new request there) after this call, in the
        same turn, so the load the check reads is the one the finish left. The tail is where
        pushes pay, and a held push released only at the next stats sweep could arrive after the
        request it was for had finished."""
        self.forget(instance, sample_id)
        if instance is not None:
            self._start(instance, check_now=False)

    def forget(self, instance: str | None, sample_id: str) -> None:
        """Drop what waits for ``sample_id`` (it finished, or left ``instance``): no engine would take it."""
        if instance is None:  # not running anywhere: nothing waits for it
            return
        waiting = self.pending.get(instance)
        if waiting is not None:
            waiting.pop(sample_id, None)
            if not waiting and instance not in self.sending:
                self.pending.pop(instance, None)

    async def _send(self, instance: str) -> None:
        """Send ``instance``'s waiting sources, one request's at a time, until none wait."""
        try:
            queue = self.pending.get(instance, {})
            while queue and self.may_push(instance):
                sample_id = next(iter(queue))
                sources = queue.pop(sample_id)
                engine = self.engines.get(instance)
                if engine is None:
                    continue
                self.calls += 1
                self.merged += len(sources) - 1
                try:
                    took = await engine.add_draft_sources(sample_id, sources)
                except Exception as err:  # noqa: BLE001 - a lost draft costs speed only
                    log.debug("draft push of %d sibling(s) to %s on %s failed: %s", len(sources), sample_id,
                              instance, err)
                    continue
                if took:  # (not ``self.taken += ... await``: the read would be from before the await)
                    self.taken += len(sources)
        finally:
            self.sending.discard(instance)
            if not self.pending.get(instance):
                self.pending.pop(instance, None)
