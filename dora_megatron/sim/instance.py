"""One simulated rollout instance: continuous batching on a virtual clock, advanced in jumps.

WHY jumps: simulating one event per generated token would cost ~10^9 events for the paper's
benchmark. While an instance's batch composition does not change, every running request gains
one token per decode step and the step time follows the closed form of
:class:`~dora_megatron.sim.cost.DecodeCost`, so the instance only needs an event at its next
request completion; any external change (a new request, a migration, a pause) first *syncs* the
instance to "now" by computing how many whole steps fit in the elapsed time.

Bookkeeping is O(1) per step jump: a request's finish step is stored as an absolute step count
of the instance (``finish_step``), and total context is ``ctx_base + batch * steps_done``.
A composition change takes effect at the last whole-step boundary (so at most a fraction of one
decode step is attributed early); admitting requests that need a prefill restarts decoding after
the prefill, at ``now + prefill``.

Speculative decoding changes only the cost of a step: the instance asks its
:class:`~dora_megatron.sim.cost.DecodeModel` for the cost in force at its current batch (verify
steps while the engine's policy speculates at that batch), which is fixed between composition
changes, so the jumps stay exact.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from dora_megatron.config.sim import CostModelConfig
from dora_megatron.sim.cost import DecodeCost, DecodeModel, kv_admit_tokens, prefill_s

READY = "ready"
SWITCHING = "switching"
PAUSED = "paused"


@dataclass
class SimRequest:
    """A sample being generated: lengths are fixed by the workload, progress by the instance."""

    sample_id: str
    group_id: str
    version: int  # version its tokens come from (partial mode may change it on resubmit)
    prompt_tokens: int
    target_tokens: int  # response length the sample will reach
    generated: int = 0  # tokens generated so far (exact when not running)
    admit_step: int = 0  # instance step count when it joined the batch
    finish_step: int = 0  # instance step count at which it completes
    admit_s: float = 0.0  # when it took its slot (for busy slot-seconds)
    #: multi-turn: the model tokens generated when each turn ends (empty: one turn to target_tokens)
    turn_ends: tuple[int, ...] = ()
    turn: int = 0  # the turn being generated (or the one whose tool runs)
    env_tokens: int = 0  # tool-result tokens in the context so far

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated + self.env_tokens

    @property
    def stop_at(self) -> int:
        """Generated tokens at which the request leaves the instance: its turn's end, or its response's."""
        return self.turn_ends[self.turn] if self.turn_ends else self.target_tokens

    @property
    def remaining(self) -> int:
        return self.stop_at - self.generated

    def restart(self) -> None:
        """Drop every turn generated so far (a trajectory interrupted is run again from its prompt)."""
        self.generated = self.turn = self.env_tokens = 0


class SimInstance:
    """Continuous-batching instance with a physical concurrency cap and a local wait queue."""

    def __init__(self, iid: str, version: int | None, cost: CostModelConfig, decode: DecodeCost | DecodeModel) -> None:
        self.iid = iid
        self.version = version
        self.cost = cost
        self.model = decode if isinstance(decode, DecodeModel) else DecodeModel(decode)
        self.spec_tokens = 0  # tokens generated in verify steps (speculation on at the batch of the time)
        self.decoded_tokens = 0  # tokens generated in all decode steps
        self.state = READY
        self.running: dict[str, SimRequest] = {}
        self.queue: deque[tuple[SimRequest, int]] = deque()  # (request, prefill tokens)
        self._finish: list[tuple[int, str]] = []  # heap of (finish_step, sample_id)
        self.steps_done = 0
        self.ctx_base = 0  # context = ctx_base + batch * steps_done
        self.t0 = 0.0  # decode progress is exact at t0 (steps_done whole steps done)
        self.switch_seq = 0  # identifies the latest SwitchVersion (stale completions are ignored)
        self.epoch = 0  # bumps on every reschedule; stale wake events are ignored
        self.busy_slot_s = 0.0  # request-slot-seconds, accumulated as requests leave
        self.window_start = 0.0  # slot-seconds before this time are not counted
        self.kv_admit_tokens = kv_admit_tokens(cost)  # device KV, plus the host tier when there is one
        self.intervals: list[tuple[float, float, int | None, str]] = []  # timeline (t0, t1, version, state)
        self._seg_start = 0.0
        self._seg_key: tuple[int | None, str] | None = None
        # dual version (orchestrator.dual_version): the old version whose requests it still finishes
        # on a second weight set, how many of them it holds (running, queued) and since when
        self.tail_version: int | None = None
        self.tail_running = 0
        self.tail_queued = 0
        self.tail_since = 0.0
        self.dual_s = 0.0  # instance-seconds holding a second weight set (the memory it costs)

    # ------------------------------------------------------------------ state
    @property
    def batch(self) -> int:
        return len(self.running)

    @property
    def context(self) -> int:
        return self.ctx_base + self.batch * self.steps_done

    @property
    def load(self) -> int:
        return len(self.running) + len(self.queue)

    def kv_usage(self) -> float:
        return min(1.0, self.context / self.kv_admit_tokens)

    def mark(self, now: float, record: bool) -> None:
        """Timeline segment bookkeeping: start a new segment when (version, activity) changes."""
        if not record:
            return
        activity = self.state if self.state != READY else ("busy" if self.running or self.queue else "idle")
        key = (self.version, activity)
        if key != self._seg_key:
            if self._seg_key is not None and now > self._seg_start:
                self.intervals.append((self._seg_start, now, self._seg_key[0], self._seg_key[1]))
            self._seg_key = key
            self._seg_start = now

    def close_timeline(self, now: float) -> None:
        if self._seg_key is not None and now > self._seg_start:
            self.intervals.append((self._seg_start, now, self._seg_key[0], self._seg_key[1]))
        self._seg_key = None

    # ---------------------------------------------------------------- advance
    @property
    def decode(self) -> DecodeCost:
        """The per-token decode cost at the current batch (verify steps where speculation applies;
        two weight reads while requests of two versions run: :meth:`DecodeCost.dual`)."""
        cost = self.model.for_batch(self.batch)
        if self.tail_running and self.tail_running < len(self.running):
            return cost.dual()
        return cost

    def keep_tail(self, now: float, arriving: int = 0) -> None:
        """A dual-version switch: every request held now (and ``arriving``: moves to it still under
        way) is of the current version, which this instance keeps for them while it loads and
        serves the next one. Nothing held (they finished in this instant): no second weight set."""
        if not self.running and not self.queue and not arriving:
            return
        self.tail_version = self.version
        self.tail_running = len(self.running)
        self.tail_queued = len(self.queue)
        self.tail_since = now

    def _tail_left(self, req: SimRequest, now: float, running: bool) -> None:
        if self.tail_version is None or req.version != self.tail_version:
            return
        if running:
            self.tail_running -= 1
        else:
            self.tail_queued -= 1
        if not self.tail_running and not self.tail_queued:  # the tail drained: its weights are dropped
            self.tail_version = None
            self.dual_s += now - self.tail_since

    def _steps_to_next_finish(self) -> int:
        return self._finish[0][0] - self.steps_done if self._finish else 0

    def sync(self, now: float, wake: bool = False) -> list[SimRequest]:
        """Advance decoding to ``now`` in whole steps; return requests that completed.

        ``wake``: ``now`` is this instance's own scheduled completion time, so the next finish
        is reached exactly (no floating-point shortfall). Completed requests leave the batch
        (their slot frees at the completion time).
        """
        if self.state != READY or not self.running or (now <= self.t0 and not wake):
            return []
        k = self._steps_to_next_finish()
        if wake:
            n = k
        else:
            n = self.decode.steps_within(self.batch, self.context, now - self.t0 + 1e-9, k)
        if n > 0:
            decode = self.decode
            self.t0 += decode.span_s(self.batch, self.context, n)
            self.steps_done += n
            self.decoded_tokens += n * self.batch
            if self.model.speculates(self.batch):  # (not by identity: a dual-version step's cost is a copy)
                self.spec_tokens += n * self.batch
        done: list[SimRequest] = []
        while self._finish and self._finish[0][0] <= self.steps_done:
            _, sid = heapq.heappop(self._finish)
            req = self.running.get(sid)
            if req is None or req.finish_step > self.steps_done:
                continue  # stale heap entry (request left earlier)
            done.append(self._remove(sid, self.t0))
        return done

    def next_wake(self) -> float | None:
        """Virtual time of the next request completion (None when nothing decodes)."""
        if self.state != READY or not self.running:
            return None
        k = self._steps_to_next_finish()
        return self.t0 + self.decode.span_s(self.batch, self.context, k)

    # ------------------------------------------------------------ membership
    def _remove(self, sid: str, now: float) -> SimRequest:
        req = self.running.pop(sid)
        self._tail_left(req, now, running=True)
        before = req.context - req.generated  # prompt and tool results: fixed while it runs
        req.generated = min(req.stop_at, req.generated + (self.steps_done - req.admit_step))
        # context bookkeeping: this request contributed its context at admit - admit_step
        self.ctx_base -= before + req.generated - self.steps_done
        self.busy_slot_s += max(0.0, now - max(req.admit_s, self.window_start))
        return req

    def _admit_running(self, req: SimRequest, now: float) -> None:
        req.admit_step = self.steps_done
        req.finish_step = self.steps_done + max(1, req.remaining)
        req.admit_s = now
        self.ctx_base += req.context - self.steps_done
        self.running[req.sample_id] = req
        if self.tail_version is not None and req.version == self.tail_version:
            self.tail_running += 1  # a queued (or arriving) tail request starts
        heapq.heappush(self._finish, (req.finish_step, req.sample_id))

    def add(self, req: SimRequest, now: float, prefill_tokens: int) -> None:
        """Admit a request (or queue it when the instance is full); ``prefill_tokens`` to compute."""
        self.sync_noop_guard(now)
        if self.queue or not self._fits(req):
            self.queue.append((req, prefill_tokens))
            if self.tail_version is not None and req.version == self.tail_version:
                self.tail_queued += 1  # a move that arrives for the tail
            return
        self._start(req, now, prefill_tokens)

    def _fits(self, req: SimRequest) -> bool:
        """Admission: a free request slot and KV room (device, plus host tier) for its context."""
        if not self.running:
            return True
        return (len(self.running) < self.cost.max_concurrent
                and self.context + req.context <= self.kv_admit_tokens)

    def sync_noop_guard(self, now: float) -> None:
        if not self.running and self.state == READY:
            self.t0 = max(self.t0, now)

    def _start(self, req: SimRequest, now: float, prefill_tokens: int) -> None:
        if prefill_tokens > 0:
            self.t0 = max(self.t0, now) + prefill_s(self.cost, prefill_tokens)
        self._admit_running(req, now)

    def fill_from_queue(self, now: float) -> None:
        while self.queue and self._fits(self.queue[0][0]):
            req, pf = self.queue.popleft()
            if self.tail_version is not None and req.version == self.tail_version:
                self.tail_queued -= 1
            self._start(req, now, pf)

    def take(self, sid: str, now: float) -> SimRequest:
        """Remove a running or queued request (migration, interrupt); call after ``sync(now)``."""
        if sid in self.running:
            return self._remove(sid, now)
        for i, (req, _) in enumerate(self.queue):
            if req.sample_id == sid:
                del self.queue[i]
                self._tail_left(req, now, running=False)
                return req
        raise KeyError(f"{sid} not on instance {self.iid}")

    def has(self, sid: str) -> bool:
        return sid in self.running or any(r.sample_id == sid for r, _ in self.queue)

    def drain_all(self, now: float) -> list[SimRequest]:
        out = [self._remove(sid, now) for sid in list(self.running)]
        for r, _ in self.queue:
            self._tail_left(r, now, running=False)
            out.append(r)
        self.queue.clear()
        self._finish.clear()
        return out

    def pause(self, now: float) -> None:
        """Freeze decoding (colocated training, elastic return); call after ``sync(now)``."""
        self.state = PAUSED
        self._pause_at = now

    def resume(self, now: float) -> None:
        self.state = READY
        self.t0 = max(self.t0, now)

    def occupied_slot_s(self, now: float) -> float:
        """Busy slot-seconds including requests still running at ``now``."""
        return self.busy_slot_s + sum(max(0.0, now - max(r.admit_s, self.window_start)) for r in self.running.values())
