"""The controller's own limits on its connections to the instances: open files, pooled sockets.

WHY a module of its own: every in-flight HTTP call to an instance holds one socket, i.e. one file
descriptor of the *controller's* process. Thousands of instances with hundreds of requests each
meet the process's open-files limit (``RLIMIT_NOFILE``) long before any instance is in trouble,
and an ``EMFILE`` ("Too many open files") on ``connect`` then looks exactly like an unreachable
instance. Three rules keep the controller's limits its own:

* :func:`raise_open_files_limit`: the soft limit is raised to the hard one at start;
* :func:`plan_connections`: the connection pools are sized from the descriptors left after a
  reserve, so excess requests *wait* for a connection (counted in :class:`ConnectionWaits`)
  instead of failing; a configuration that cannot run at all (not one generate connection per
  instance) is refused at start with the numbers;
* :func:`local_resource_error`: an error of this process (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
  ``ENOMEM``, ``EADDRNOTAVAIL`` (no ephemeral port left), a pool that gave no connection in time)
  is told apart from an instance's, so the runtime retries or re-queues instead of failing the
  instance.
"""

from __future__ import annotations

import errno
import logging
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: errno values that are this process's (or this host's) shortage, never the peer's doing
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})
#: descriptors kept out of the connection pools: the interpreter's own files, logs, the journal,
#: pipes to child processes, the trainer's and the client workers' sockets, health checks at start
DESCRIPTOR_RESERVE = 128
#: connections per instance beside its generates: a stats poll and an abort or weight load, which
#: must never queue behind long generates (a poll that waits would time out and fail the instance)
CONTROL_CONNECTIONS = 2


class ControllerResourceError(RuntimeError):
    """A call to an instance could not be made for want of a resource of the controller's own
    process (no descriptor, no buffer, no free pooled connection in time). Not the instance's
    fault: callers retry or re-queue, never fail the instance for it."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: local resource shortage (the controller's, not the instance's): {reason}")
        self.url = url
        self.reason = reason


class ConnectionBudgetError(ValueError):
    """The configured concurrency cannot run within this process's open-files limit."""


def local_resource_error(err: BaseException | None) -> bool:
    """Whether ``err`` (or anything it wraps: ``os_error`` of aiohttp's connector errors,
    ``__cause__``, ``__context__``) is a shortage of this process rather than an instance's fault."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ControllerResourceError):
            return True
        if isinstance(err, OSError) and err.errno in LOCAL_ERRNOS:
            return True
        inner = getattr(err, "os_error", None)  # aiohttp.ClientConnectorError keeps the OSError here
        if isinstance(inner, OSError) and inner.errno in LOCAL_ERRNOS:
            return True
        err = err.__cause__ or err.__context__
    return False


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (no privilege needed); returns (old, new)
    soft limits and logs the change. WHY at start: distributions default the soft limit to 1,024
    while the hard one is far higher, and each in-flight request holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as exc:  # e.g. a hard limit above the kernel's nr_open
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    if new != soft:
        log.info("open-files limit (RLIMIT_NOFILE) raised from %d to %d (the hard limit)", soft, new)
    return soft, new


class ConnectionWaits:
    """Back-pressure count: calls that waited for a connection because the pools were full
    (``connection_waits`` in summary.json). One per process; plain ints (one event loop)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int = 1) -> None:
        self.count += n


#: requests in flight in one process above which ``dora train`` suggests ``rollout.client_workers``.
#: WHY: each holds about 80 objects the garbage collector tracks, and a full collection scans them
#: all with every thread of the process stopped: up to 0.6 s at 8,192 in the controller's process
#: (``docs/results/controller_scale.md``), its loop stopped for the whole cluster meanwhile
MANY_IN_FLIGHT = 4096
#: kernel receive-buffer bytes one process's generate connections share (:attr:`ConnectionPlan.receive_buffer`):
#: a sixth of the TCP memory at which a 24 GB Linux host starts to drop (its ``tcp_mem`` pressure mark, ~1.5 GB)
KERNEL_RECEIVE_BYTES = 256 << 20
#: the smallest receive buffer a generate connection gets (64 KiB charged): a window that still
#: moves an answer at a hundred MB/s or more at a datacenter's sub-millisecond round trip
MIN_RECEIVE_BUFFER = 32 << 10
#: at or above this share, the kernel's autotuning is left alone (Linux's default ``tcp_rmem`` maximum)
AUTOTUNED_RECEIVE_BUFFER = 6 << 20


@dataclass(frozen=True)
class ConnectionPlan:
    """How many connections each instance's client may hold in one process.

    ``instances``: the instances whose clients live in this process; ``slots``: requests the
    orchestrator runs on each at once; ``descriptors``: the soft open-files limit; ``generate`` /
    ``control``: connections per instance for generates and for the other calls."""

    instances: int
    slots: int
    descriptors: int
    reserve: int
    generate: int
    control: int
    client_workers: int = 0

    @property
    def wanted(self) -> int:
        """Descriptors the configured concurrency needs: one socket per in-flight request."""
        return self.instances * (self.slots + self.control) + self.reserve

    @property
    def fits(self) -> bool:
        """Whether every slot gets its own connection (no request ever waits for one)."""
        return self.generate >= self.slots

    @property
    def receive_buffer(self) -> int | None:
        """The kernel receive buffer (``SO_RCVBUF``) of each generate connection: this process's
        share of :data:`KERNEL_RECEIVE_BYTES`, at least :data:`MIN_RECEIVE_BUFFER`; None (the
        kernel's autotuning, up to MBs a socket) where the share is larger than the kernel's own
        default maximum would give anyway.

        WHY: answers that finish while the process is busy wait in these buffers (the process
        reads at most :data:`~dora_megatron.comm.receive_budget.RECEIVE_BUDGET_BYTES` of them at
        once). Autotuned, thousands of waiting answers took 1.7 GB of the kernel's TCP memory at 64
        instances x 64 slots, past its pressure limit: it then dropped packets on every socket, and
        retransmission back-offs stalled every answer and stats poll for seconds
        (``docs/results/controller_scale.md``). Bounded, the rest of an answer waits in the
        engine's send buffer, on the engine's host."""
        share = KERNEL_RECEIVE_BYTES // max(1, self.instances * self.generate)
        # Linux charges twice the size set (its bookkeeping): half the share is what is set
        return None if share >= AUTOTUNED_RECEIVE_BUFFER else max(MIN_RECEIVE_BUFFER, share // 2)

    @property
    def in_flight(self) -> int:
        """Requests on the wire in this process at most: one per generate connection, one per slot."""
        return self.instances * min(self.generate, self.slots)

    def describe(self) -> str:
        where = (f"each of rollout.client_workers={self.client_workers} processes holds {self.instances}"
                 if self.client_workers else f"the controller holds {self.instances}")
        return (f"{where} instance(s) x {self.slots} slot(s) (+{self.control} control connections each) "
                f"+ a reserve of {self.reserve} = {self.wanted} descriptors wanted; the open-files limit is "
                f"{self.descriptors}: {self.generate} generate connection(s) per instance")


def plan_connections(instances: int, slots: int, descriptors: int, *, client_workers: int = 0,
                     reserve: int = DESCRIPTOR_RESERVE, control: int = CONTROL_CONNECTIONS) -> ConnectionPlan:
    """Size each instance's pool from ``descriptors`` (the soft open-files limit, raised first).

    With ``client_workers`` > 0 the clients are spread over that many processes (each with the
    same limit), so one process holds ``ceil(instances / client_workers)``. Each instance gets
    ``control`` connections and ``min(slots, share - control)`` for generates, where ``share``
    is its part of the descriptors left after ``reserve``; requests beyond it wait for a
    connection. Raises :class:`ConnectionBudgetError` naming the numbers and
    ``rollout.client_workers`` when not even one generate connection per instance fits."""
    if instances < 0 or slots < 1 or descriptors < 0 or reserve < 0 or control < 0 or client_workers < 0:
        raise ValueError(f"bad connection plan inputs: instances={instances} slots={slots} "
                         f"descriptors={descriptors} reserve={reserve} control={control} "
                         f"client_workers={client_workers}")
    per_process = -(-instances // client_workers) if client_workers else instances
    share = (descriptors - reserve) // per_process if per_process else slots + control
    generate = min(slots, share - control)
    if generate < 1:
        need = per_process * (1 + control) + reserve
        wanted = per_process * (slots + control) + reserve
        workers = max(1, client_workers)
        suggest = max(workers + 1, -(-instances * (1 + control) // max(1, descriptors - reserve)))
        full = max(workers + 1, -(-instances * (slots + control) // max(1, descriptors - reserve)))
        raise ConnectionBudgetError(
            f"{per_process} instance(s) x {slots} slot(s) in one process need {wanted} open files "
            f"({per_process} x ({slots} + {control} control) + {reserve} reserved), and at least {need} to run "
            f"with one generate connection per instance, but the open-files limit (RLIMIT_NOFILE, hard) is "
            f"{descriptors}: raise it (ulimit -Hn) or spread the instances' clients over more processes with "
            f"rollout.client_workers (at least {suggest}; {full} for a connection per slot; now {client_workers})")
    return ConnectionPlan(per_process, slots, descriptors, reserve, generate, control, client_workers)
