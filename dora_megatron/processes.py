"""Child processes of a job: what to run (:class:`ProcessSpec`), start with logs, wait for health,
stop without orphans.

WHY outside ``launch/``: the rollout adapters (SGLang and vLLM servers, a vLLM mode switch) and
the checkpoint converter start children too; they use these primitives without depending on the
launchers (``.importlinter``).

Every child runs in its own session (process group) so that stopping it also
stops what it spawned (torchrun's ranks); stop is SIGTERM, a grace period, then
SIGKILL of the whole group. A :class:`ProcessSet` is a context manager, so
success, an exception and Ctrl-C all end in the same cleanup.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a plan: plain data, so a plan can be printed and checked before it runs."""

    role: str  # "engine", "trainer", "controller"
    name: str
    host: str
    argv: tuple[str, ...]
    port: int | None = None
    threads: int = 1
    ranks: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # CPU affinity (empty = not pinned)
    gpus: tuple[int, ...] = ()  # GPU indices on ``host`` this process uses (empty: none / CPU)
    extra_ports: dict[str, int] = field(default_factory=dict)  # other ports it binds on ``host`` (nccl, store ...)
    #: job addresses whose ports it binds, picked on ``host`` when it starts (``{port:<name>}`` in argv;
    #: :mod:`dora_megatron.launch.addresses`)
    auto_ports: tuple[str, ...] = ()

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {cmd}".strip()


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    log_file: IO
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cpus: tuple[int, ...] = ()
    redact: tuple[str, ...] = ()  # strings its log never shows (see :func:`_relay_redacted`)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def failure(self) -> str:
        """Why the child exited: its exit status, its own last error line, then its log tail."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        error = last_error_line(text)
        head = f"{self.name} exited with status {self.popen.returncode}" + (f": {error}" if error else "")
        return f"{head}\nlast log lines:\n{self.tail()}"


#: ``SomeError: message`` (optionally behind torchrun's ``[rankN]:`` prefix), the last line of a traceback
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b:?.*)$")
#: what torchrun and its elastic agent add after the child's own error: never the cause
_LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")


def last_error_line(log_text: str) -> str | None:
    """The last exception line a child wrote (``ValueError: ep=2 needs ...``), skipping torchrun's
    own ``ChildFailedError`` / ``SignalException`` banner lines, which only say that a rank failed."""
    for line in reversed(log_text.splitlines()):
        m = _ERROR_LINE.match(line.strip())
        if m and not any(name in m.group(1).split(":")[0] for name in _LAUNCHER_ERRORS):
            return m.group(1).strip()
    return None


def _pdeathsig_setter():
    """``set(sig) -> bool``: PR_SET_PDEATHSIG for the calling process (Linux, glibc), or None where
    there is none. Loaded before any fork: a forked child only calls it (no library load there)."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1
    return lambda sig: prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Linux: deliver ``sig`` to this process when its parent dies, even by SIGKILL (no orphans).
    False where it cannot be set (not Linux / no glibc: the context-manager cleanup still applies)."""
    setter = _pdeathsig_setter()
    return setter is not None and setter(sig)


#: the pid a process tied by :func:`end_with_parent` leaves to the interpreters it spawns: whom they
#: must end with (a spawned child cannot tell a parent that already died from a live one otherwise)
PARENT_PID_ENV = "DORA_PARENT_PID"


def end_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Tie this process and every process it forks later to its parent: each gets ``sig`` when its
    own parent dies, whatever killed that parent.

    WHY the trainer's ranks call it: torchrun starts each rank in a session of its own, so the
    launcher's kill of torchrun's process group never reaches a rank, nor what a rank started
    (Megatron's checkpoint writers, ``multiprocessing`` children); a rank SIGKILLed (OOM, a lost
    node) left those orphaned under init, holding memory (on a GPU node, device memory) after the
    job ended. With a parent-death signal at every level, killing torchrun ends its ranks and
    killing a rank ends its children; a ``multiprocessing`` resource tracker ends by itself once
    the last process holding its pipe is gone. Forked children get it through
    :func:`os.register_at_fork`; spawned ``multiprocessing`` children call this with
    ``parent=`` the pid in :data:`PARENT_PID_ENV` when they import the main module
    (``dora_megatron.trainer.service``). ``parent``: the pid this process must outlive not (default:
    its parent now); when it is already gone the signal could never come, so the process ends at once."""
    setter = _pdeathsig_setter()
    if setter is None:
        return
    _tie_to(setter, sig, os.getppid() if parent is None else parent)
    me = os.getpid()
    os.environ[PARENT_PID_ENV] = str(me)
    os.register_at_fork(after_in_child=lambda: _tie_to(setter, sig, me))


def _tie_to(setter, sig: int, parent: int) -> None:
    """Set the parent-death signal, then end at once if ``parent`` died before it took effect (this
    process was re-parented: its parent-death signal would never come)."""
    if setter(sig) and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _ignore_the_jobs_warning() -> None:
    """The child (and what it starts: torchrun's ranks) ignores SIGUSR1, the job's early warning.

    WHY: the warning is the launcher's (:mod:`dora_megatron.launch.stop`: checkpoint at the next
    step boundary, then exit), but SLURM delivers a signal that ``srun`` passes on to every process
    of the job step, the launcher's children too, and SIGUSR1's default action ends a process: the
    trainer died of the warning that asked it for a checkpoint. An ignored disposition survives
    ``exec`` and is inherited, so the whole tree ignores it unless a program installs a handler."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _relay_redacted(pipe: IO[bytes], out: IO[bytes], redact: tuple[str, ...]) -> None:
    """Copy a child's output to its log line by line, each of ``redact`` replaced.

    WHY: SGLang 0.5.23 logs its resolved arguments at start, its ``api_key`` included
    (``entrypoints/engine.py``: ``server_args=...``), and the job's secret must be in no log. Whole
    lines are copied, so a secret (no newline in it) is never split across two writes. Ends when
    the child and everything it started have closed the pipe, or when the log is closed (the child
    was stopped)."""
    secrets = [r.encode() for r in redact]
    try:
        for line in iter(pipe.readline, b""):
            for secret in secrets:
                line = line.replace(secret, b"<redacted>")
            out.write(line)
    except (OSError, ValueError):  # the log was closed under it: the child was stopped
        pass
    finally:
        pipe.close()


class ChildFailed(RuntimeError):
    pass


class ProcessSet:
    """The children a launcher starts, stopped together.

    WHY every child is forked by one thread of the set's own: Linux sends a child's parent-death
    signal when the *thread* that forked it ends, not the process. A restart run from a worker
    thread (``asyncio.to_thread`` in the start-up wait, whose event loop and executor end when the
    start-up does) gave the new engine a SIGTERM as soon as that thread went away; the set's
    spawner thread lives as long as the set."""

    def __init__(self, log_dir: Path, grace_s: float = 20.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.children: list[Child] = []
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dora-spawner")

    def __enter__(self) -> "ProcessSet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cpus: Sequence[int] = (), redact: Sequence[str] = ()) -> Child:
        """Start child ``name``; its output goes to ``<log_dir>/<name>.log``, with each string of
        ``redact`` written as ``<redacted>`` (a program that logs a credential it was given)."""
        log_path = self.log_dir / f"{name}.log"
        fh = open(log_path, "ab", buffering=0)
        redact = tuple(r for r in redact if r)
        full_env = {**os.environ, **(env or {})}
        pinned: set[int] = set()
        if cpus:
            available = os.sched_getaffinity(0)
            missing = sorted(set(cpus) - available)
            if missing:
                raise ValueError(f"{name}: CPU cores {missing} are not available here (have {sorted(available)})")
            pinned = set(cpus)

        def preexec() -> None:  # runs in the child before exec
            _die_with_parent()
            _ignore_the_jobs_warning()
            if pinned:
                os.sched_setaffinity(0, pinned)

        popen = self._spawner.submit(subprocess.Popen, list(argv), stdout=subprocess.PIPE if redact else fh,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                     start_new_session=True, preexec_fn=preexec).result()
        if redact:
            threading.Thread(target=_relay_redacted, args=(popen.stdout, fh, redact), daemon=True,
                             name=f"dora-log-{name}").start()
        child = Child(name, popen, log_path, fh, tuple(argv), dict(env or {}), tuple(cpus), redact)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return child

    def restart(self, name: str, argv: Sequence[str] | None = None) -> Child:
        """Stop child ``name`` (its whole group, if still alive) and start it again with the same
        environment and CPUs, and ``argv`` (default: the same); it keeps its place and its log file."""
        index = next(i for i, c in enumerate(self.children) if c.name == name)
        old = self.children[index]
        self._kill(old)
        old.log_file.write(f"\n--- restarted by the launcher at {time.strftime('%H:%M:%S')} ---\n".encode())
        old.log_file.close()
        self.children.pop(index)
        new = self.start(name, argv if argv is not None else old.argv, old.env, cpus=old.cpus, redact=old.redact)
        self.children.insert(index, self.children.pop())
        return new

    def _kill(self, child: Child, wait_s: float = 10.0) -> None:
        """SIGKILL the child's whole process group (torchrun ranks included) and reap it."""
        try:
            os.killpg(child.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            child.popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not exit after SIGKILL", child.name, child.popen.pid)

    def check_alive(self) -> None:
        for c in self.children:
            if not c.alive():
                raise ChildFailed(c.failure())

    def stop(self, child: Child, sig: int = signal.SIGTERM) -> None:
        if child.alive():
            try:
                os.killpg(child.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        for c in self.children:
            self.stop(c)
        deadline = time.monotonic() + self.grace_s
        for c in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                c.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit after SIGTERM; killing", c.name)
            # kill the whole group in any case: children of the child (torchrun ranks) may linger
            self._kill(c, wait_s=5.0)
            c.log_file.close()
        self._spawner.shutdown(wait=False)
