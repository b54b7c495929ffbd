"""A real one-host SLURM cluster for the tests: munged, slurmctld and three slurmds (n1-n3).

WHY real daemons: the sbatch templates must be proven the way users run them (``sbatch``, job
states, ``scancel``, ``srun --kill-on-bad-exit``), which fakes of the SLURM environment cannot.
Debian's ``slurmd`` is built with multiple-slurmd support, so one host emulates three nodes, each
with its own port and loopback address (``NodeAddr`` 127.0.0.1/2/3, names in ``/etc/hosts``).
Everything the daemons write (state, spool, logs, pid files, the munge socket) lives in one
temporary folder; :meth:`SlurmCluster.stop` stops every daemon it started by its pid.

WHY ``MessageTimeout=60`` and ``BatchStartTimeout=120`` (SLURM's defaults are 10 s each): the
daemons share the machine with the jobs under test and with other work. A slurmd that answers the
batch launch later than ``MessageTimeout`` (a loaded 2-core machine) makes slurmctld count the
launch failed; one whose next report to slurmctld does not list a batch job allocated more than
``BatchStartTimeout`` plus 10 s earlier makes slurmctld call the job missing ("not found
BatchStartTime after startup"). Either way the job is requeued and then stays PENDING (reason
``BeginTime``) past any test's wait, its output file never written.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.3"}
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sacct")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


def missing_binaries() -> list[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return [b for b in BINARIES if b != "sacct" and shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))
    if found is None:
        raise FileNotFoundError(name)
    return found


def ensure_hosts(path: Path = Path("/etc/hosts")) -> str | None:
    """Add ``n1``-``n3`` to ``/etc/hosts`` unless they resolve already (idempotent). Returns a problem or None."""
    def resolved() -> bool:
        try:
            return all(socket.gethostbyname(n) == a for n, a in NODES.items())
        except OSError:
            return False

    if resolved():
        return None
    try:
        text = path.read_text()
        lines = [f"{a} {n}" for n, a in NODES.items() if f"{a} {n}" not in text.split("\n")]
        with open(path, "a") as fh:
            fh.write(("" if text.endswith("\n") else "\n") + "\n".join(lines) + "\n")
    except OSError as err:
        return f"cannot add n1-n3 to {path}: {err}"
    return None if resolved() else f"n1-n3 do not resolve to {NODES} after editing {path}"


def _free_port() -> int:
    """A daemon's port: from the allocator's range for non-job ports, which no job's service ever
    picks from (the engine's once-fixed 30000 was a slurmd's port and failed every test)."""
    from dora_megatron.ports import free_port

    return free_port()


def slurm_conf(d: Path, ctld_port: int, node_ports: dict[str, int], cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={host} Port={node_ports[n]} CPUs={cpus} "
                      f"RealMemory=2000 State=UNKNOWN" for n, a in NODES.items())
    return f"""# one host, three emulated nodes (multiple-slurmd); written by tests/helpers/slurm_cluster.py
ClusterName=dora-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=20
MessageTimeout=60
BatchStartTimeout=120
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path = field(init=False)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for the client commands (``sbatch``, ``squeue`` ...)."""
        return {**os.environ, "SLURM_CONF": str(self.conf),
                "PATH": os.pathsep.join([os.environ.get("PATH", ""), *SBIN])}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=self.env, start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def start(self, cpus: int = 1, timeout_s: float = 60.0) -> None:
        for sub in ("munge", "ctld", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.root}/munge/munge.socket", f"--pid-file={self.root}/munge/munged.pid",
                               f"--log-file={self.root}/log/munged.log", f"--seed-file={self.root}/munge/seed"])
        self._wait(lambda: (self.root / "munge" / "munge.socket").exists(), timeout_s, "munged socket")
        ports = {n: _free_port() for n in NODES}
        self.conf.write_text(slurm_conf(self.root, _free_port(), ports, cpus))
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in NODES:
            self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self._nodes_idle, timeout_s, "three idle nodes (sinfo)")

    def reset(self, timeout_s: float = 120.0) -> None:
        """Make the cluster as a new test expects it, whatever the last test left: a daemon that died
        restarts the whole cluster; otherwise every job left is cancelled and every node that is
        down or drained (a job that failed on it) is resumed, until the queue is empty and every node
        idle. WHY: the module shares one cluster; one test's failed job must not fail the next ones."""
        if any(p.poll() is not None for p in self.procs):
            self.stop()
            self.start()
            return
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env,
                                 timeout=30)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            stuck = [n for n, st in states.items() if st.rstrip("*~#$@") in ("down", "drain", "drng", "fail", "failg")]
            if stuck:
                subprocess.run(["scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME"], env=self.env,
                               capture_output=True, timeout=30)
            queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env, timeout=30)
            if queue.returncode == 0 and not queue.stdout.strip() and self._nodes_idle():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM test cluster: not reset after {timeout_s:.0f} s\n" + self.diagnosis())
            time.sleep(0.5)

    def _nodes_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"a SLURM daemon exited ({p.args[0]}, status {p.returncode}); logs in {self.root}/log:\n"
                                   + self.logs_tail())
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def logs_tail(self, lines: int = 20) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    @staticmethod
    def _wait(cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM test cluster: no {what} after {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel what still runs (a failed test may leave a job), then SIGTERM every daemon this
        object started (slurmds first) and SIGKILL what is left."""
        if self.procs:  # also when a daemon died: job steps are not its children and would run on
            try:
                subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.procs and all(p.poll() is None for p in self.procs):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True,
                                     timeout=30)
                if out.returncode != 0 or not out.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd,
                             env={**self.env, **(env or {})}, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=self.env)
        for item in out.stdout.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return "UNKNOWN"

    def wait_state(self, job: str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.state(job)
            if s in states:
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} is {s}, not one of {sorted(states)}, after {timeout_s:.0f} s\n"
                                   + self.diagnosis(job))
            time.sleep(0.5)

    def diagnosis(self, job: str | None = None) -> str:
        """What SLURM says about a job that did not reach a state: its own record (``Reason``,
        ``BeginTime``, ``Restarts``), every job in the queue, the nodes' states with their reasons,
        and the daemons' log tails. WHY: a job left PENDING under load was once undiagnosable from
        the state name alone."""
        def run(*argv: str) -> str:
            try:
                out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=30)
                return (out.stdout + out.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as err:
                return f"{argv[0]}: {err}"

        parts = [f"--- scontrol show job {job}\n" + run("scontrol", "-o", "show", "job", job)] if job else []
        parts += ["--- squeue\n" + run("squeue", "-o", "%i %T %r %D %N %S"),
                  "--- sinfo\n" + run("sinfo", "-N", "-h", "-o", "%N %T %E"),
                  self.logs_tail()]
        return "\n".join(parts)

    def wait_quiet(self, timeout_s: float) -> None:
        """Wait until the queue is empty and every node is idle: a test that needs the whole cluster
        (``--nodes=3``) must not wait behind an earlier test's job still completing."""
        def quiet() -> bool:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env, timeout=30)
            return out.returncode == 0 and not out.stdout.strip() and self._nodes_idle()

        deadline = time.monotonic() + timeout_s
        while not quiet():
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM test cluster: not quiet after {timeout_s:.0f} s\n" + self.diagnosis())
            time.sleep(0.5)

    def scancel(self, job: str, *args: str) -> None:
        subprocess.run(["scancel", *args, job], check=True, env=self.env, timeout=30)


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
