"""Load harness: the real controller runtime of ``dora train`` against N fake SGLang instances.

``python tools/controller_scale.py --instances N --steps K --out FILE.json``

WHY: the simulator prices the orchestrator's decisions on a virtual clock; this measures the
asyncio controller itself (SGLang HTTP clients, stats polling every
``observability.stats_interval_s``, one task per request, journal writes, JSON parsing) at
cluster scale. The controller is built by the launcher's own wiring
(:func:`dora_megatron.controller.main.run_controller`, the path SLURM jobs take with engine URLs),
so what runs is exactly the production runtime with ``rollout.engine: sglang``; only the engines
(``tools/fake_fleet.py``, many per process on 127.0.0.1) and the trainer are fakes.

Measured in this process (the controller): event-loop lag (a 20 ms ticker's lateness), CPU
seconds per 1,000 finished samples, peak RSS; the lag and the CPU also until the runtime ended
(``run_*``: without the run's end work, the last checkpoint, the model's export with torch's
import and the overview plot, which a short run would spread over its few samples). Measured on the fakes' side: the interval between
two stats polls of one instance (``stats_interval_s`` + the time one sweep over every instance
takes), and the time from a trainer step's end to each instance's load of the new version.
Checked: lost / duplicated groups and C1/C3 from the run summary, groups the fake trainer saw
twice or incomplete, and instances the controller declared failed (every one is a false
failure: the fakes never fail). Exit 0 when every invariant holds, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_fleet import raise_fd_limit  # noqa: E402

log = logging.getLogger("controller_scale")

FLEET = Path(__file__).resolve().parent / "fake_fleet.py"


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class LagMonitor:
    """Samples how late a ``period_s`` sleep wakes up: the event loop's lag behind its work."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self.stalls: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self._watch: threading.Thread | None = None
        #: garbage collections during the run: per generation, how many and the longest (ms), in
        #: any thread: a full one pauses every thread (the loop's included) for as long as it scans
        self.gc: dict[int, list[float]] = {}
        self.gc_running = False
        self._gc_t0 = 0.0
        self._gc_total_ms = 0.0
        #: every tick at least ``long_s`` late: its lag, the CPU the loop's thread and the whole
        #: process used meanwhile, the collections' time, and where the watchdog saw the loop's
        #: thread on each look during it. WHY the CPU: a loop thread that ran for the whole stall
        #: was busy with work of its own (a long callback, a collection); one that hardly ran while
        #: the process did waited for the GIL (another thread of the process); one that hardly ran
        #: while the process hardly did was not given a core (CPU starvation by other processes).
        self.long_s = 0.5
        self.long_stalls: list[dict[str, Any]] = []
        self._looks: dict[float, list[str]] = {}
        self._t_start = 0.0

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_running, self._gc_t0 = True, time.perf_counter()
            return
        self.gc_running = False
        ms = (time.perf_counter() - self._gc_t0) * 1000
        self._gc_total_ms += ms
        self.gc.setdefault(info["generation"], []).append(ms)

    def gc_report(self) -> dict[str, dict[str, float]]:
        return {f"gen{g}": {"count": len(v), "max_ms": max(v), "total_ms": sum(v)} for g, v in sorted(self.gc.items())}

    def start(self, stall_s: float = 0.0, long_s: float = 0.5) -> None:
        """``stall_s`` > 0: a watchdog thread records where the loop's thread is whenever no tick
        came for ``stall_s`` (what blocks the loop, by innermost project frame); ticks ``long_s``
        late are recorded one by one (:attr:`long_stalls`)."""
        self.long_s = long_s
        self._last_tick = self._t_start = time.monotonic()
        gc.callbacks.append(self._gc_callback)
        self._task = asyncio.get_running_loop().create_task(self._run())
        if stall_s > 0:
            self._stop_watch = threading.Event()
            self._watch = threading.Thread(target=self._watchdog, args=(threading.get_ident(), stall_s), daemon=True)
            self._watch.start()

    async def _run(self) -> None:
        while True:
            t, since = time.monotonic(), self._last_tick
            loop_cpu, proc_cpu, gc_ms = time.thread_time(), time.process_time(), self._gc_total_ms
            await asyncio.sleep(self.period_s)
            self._last_tick = now = time.monotonic()
            lag = max(0.0, now - t - self.period_s)
            self.lags.append(lag)
            looks = self._looks.pop(since, [])
            if lag >= self.long_s:
                where: dict[str, int] = {}
                for key in looks:
                    where[key] = where.get(key, 0) + 1
                self.long_stalls.append({
                    "at_s": round(t - self._t_start, 2), "lag_ms": round(lag * 1000),
                    "loop_thread_cpu_ms": round((time.thread_time() - loop_cpu) * 1000),
                    "process_cpu_ms": round((time.process_time() - proc_cpu) * 1000),
                    "gc_ms": round(self._gc_total_ms - gc_ms), "where": where})

    def _watchdog(self, loop_thread: int, stall_s: float) -> None:
        seen = None
        while not self._stop_watch.wait(stall_s / 4):
            tick = self._last_tick
            if time.monotonic() - tick < stall_s:
                continue
            first, seen = seen != tick, tick
            frame = sys._current_frames().get(loop_thread)
            stack = traceback.extract_stack(frame) if frame is not None else []
            ours = [f for f in stack if "dora_megatron" in f.filename]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(ours[-3:]))
            inner = f"{Path(stack[-1].filename).name}:{stack[-1].lineno}:{stack[-1].name}" if stack else "?"
            # the innermost frame too (a library's, e.g. aiohttp's reader), and whether the
            # collector was running (a full collection stops whatever thread allocated)
            key = (f"{inner} in {where}" if where and stack[-1] is not ours[-1] else where or inner) + \
                (" [gc running]" if self.gc_running else "")
            self._looks.setdefault(tick, []).append(key)  # every look during a stall (long_stalls)
            if first:  # one sample per stall
                self.stalls[key] = self.stalls.get(key, 0) + 1

    async def stop(self) -> None:
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._watch is not None:
            self._stop_watch.set()
            self._watch.join(timeout=5)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HeldTokens:
    """Samples, every ``period_s``, the tokens the controller's sample store holds (prompt and
    output of its outstanding samples) and the process's RSS: the controller's memory per token it
    holds, against the bytes those tokens take as arrays."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.peak_tokens = 0
        self.rss_at_peak = 0
        self.rss_at_start = 0
        self.rising: list[tuple[int, int]] = []  # (held tokens, RSS) of each sample up to the peak
        self._task: asyncio.Task | None = None

    def start(self, rt) -> None:
        self.rss_at_start = _rss_bytes()
        self._task = asyncio.get_running_loop().create_task(self._run(rt))

    async def _run(self, rt) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            held = sum(len(r.response_ids) + len(r.prompt_ids) for r in list(rt.store.samples.values()))
            if held > self.peak_tokens:
                self.peak_tokens, self.rss_at_peak = held, _rss_bytes()
                self.rising.append((held, self.rss_at_peak))

    def slope(self) -> float | None:
        """RSS bytes per further held token while the held tokens rise to their peak (least
        squares): what each token costs, without what the run holds whatever its tokens (the
        connections of every slot, their buffers, the clients), which the growth from the start
        counts too."""
        if len(self.rising) < 3:
            return None
        n = len(self.rising)
        mx = sum(t for t, _ in self.rising) / n
        my = sum(r for _, r in self.rising) / n
        var = sum((t - mx) ** 2 for t, _ in self.rising)
        return sum((t - mx) * (r - my) for t, r in self.rising) / var if var else None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def build_config(args: argparse.Namespace, run_dir: Path, model_dir: Path):
    """The ``dora train`` config of the measured run: SGLang engines, DORA, journal on."""
    from dora_megatron.config.schema import load_config

    slots = args.slots
    groups_in_flight = max(1, args.instances * slots // args.group_size)
    tbs = args.tbs or max(1, groups_in_flight // 2)
    overrides = [
        "rollout.engine=sglang", "rollout.device=cuda",  # fakes: the device is never used
        f"rollout.max_running={slots}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"orchestrator.mode={args.mode}", f"orchestrator.group_size={args.group_size}",
        f"orchestrator.tbs={tbs}", f"orchestrator.rbs={max(tbs, args.rbs or groups_in_flight)}",
        f"orchestrator.cap_before_rebalance={slots}", f"orchestrator.cap_after_rebalance={slots}",
        f"run.steps={args.steps}", f"run.checkpoint_interval={args.steps}", f"run.run_dir={run_dir}",
        f"model.path={model_dir}", "controller.journal=true", "launch.restart_engines=false",
        "observability.tensorboard=false", "observability.timeline=false", "observability.progress=false",
        f"observability.stats_interval_s={args.stats_interval_s}",
        *([f"rollout.client_workers={args.workers_now}"] if getattr(args, "workers_now", None) is not None else []),
        *(["algo.router_agreement=true"] if args.routed_experts else []),  # the engines' routed experts, to the trainer
        *args.set,
    ]
    return load_config(None, overrides)


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM), so that a second run in this process reports its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def _wait_ready(paths: list[Path], procs, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        procs.check_alive()
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise TimeoutError(f"fake fleet not listening after {timeout_s:.0f} s: {missing}")
        await asyncio.sleep(0.1)
    return [json.loads(p.read_text()) for p in paths]


async def _get_json(url: str) -> Any:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.get(url) as resp:
            return await resp.json()


async def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from dora_megatron.config.base import ConfigError
    from dora_megatron.data.tokenizer import save_tokenizer
    from dora_megatron.controller.main import Endpoints, run_controller
    from dora_megatron.launch.process_launcher import ProcessLauncher
    from dora_megatron.processes import ProcessSet

    run_dir, model_dir = work / "run", work / "model"
    model_dir.mkdir(parents=True)
    save_tokenizer(model_dir)
    (run_dir / "logs").mkdir(parents=True)
    cfg = build_config(args, run_dir, model_dir)
    per_proc = -(-args.instances // args.procs)
    counts = [min(per_proc, args.instances - i * per_proc) for i in range(args.procs)]
    counts = [c for c in counts if c > 0]
    py = sys.executable
    nice = ["nice", "-n", str(args.fleet_nice)] if args.fleet_nice else []  # nice execs: the pid stays the fake's
    with ProcessSet(work / "fleet_logs", grace_s=10.0) as procs:  # stopped by pid on exit
        ready = [work / f"fleet{i}.json" for i in range(len(counts))]
        for i, n in enumerate(counts):
            procs.start(f"fleet{i}", [*nice, py, str(FLEET), "--instances", str(n), "--ready", str(ready[i]),
                                      "--per-token-s", str(args.per_token_s), "--min-tokens", str(args.min_tokens),
                                      "--alpha", str(args.alpha), "--load-s", str(args.load_s),
                                      *(["--routed-experts", args.routed_experts] if args.routed_experts else []),
                                      "--max-tokens", str(args.max_new_tokens + 1024)],
                        cpus=args.others_cpus)
        trainer_ready = work / "trainer.json"
        procs.start("trainer", [py, str(FLEET), "--role", "trainer", "--ready", str(trainer_ready),
                                "--step-s", str(args.step_s), "--run-dir", str(run_dir), "--dp", str(args.trainer_dp)],
                    cpus=args.others_cpus)
        if args.controller_cpus:  # after the fakes started (they get their own cores), before the controller's
            _pin_this_process(args.controller_cpus)
        fleets = await _wait_ready([*ready, trainer_ready], procs, args.startup_timeout_s)
        if args.controller_open_files:  # the fakes keep theirs: they stand in for other machines
            resource.setrlimit(resource.RLIMIT_NOFILE, (args.controller_open_files, args.controller_open_files))
        engine_ports = [p for f in fleets[:-1] for p in f["ports"]]
        urls = {f"engine{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(engine_ports)}
        trainer_url = f"http://127.0.0.1:{fleets[-1]['ports'][0]}"
        holder: dict[str, Any] = {}
        lag = LagMonitor(args.lag_period_s)
        held = HeldTokens()
        _reset_peak_rss()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        ruc0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        load_before = os.getloadavg()

        def on_runtime(rt) -> None:
            holder["runtime"] = rt
            holder["t_run"] = time.monotonic()
            holder["ru_run"] = resource.getrusage(resource.RUSAGE_SELF)  # CPU from here: not the startup
            holder["fds_at_start"] = _open_fds()  # what the connection budget's reserve must cover
            if args.others_cpus:  # the client workers were spawned by the controller, on its cores: move them
                for pid in {getattr(e, "worker_pid", None) for e in rt.engines.values()} - {None}:
                    os.sched_setaffinity(pid, args.others_cpus)
                    holder.setdefault("worker_cpus", {})[pid] = sorted(os.sched_getaffinity(pid))
            held.start(rt)
            holder["at_end"] = asyncio.get_running_loop().create_task(_at_run_end(rt, lag, holder))
            lag.start(args.stall_s)  # from the runtime's start: startup (health checks of N URLs) is not the steady state
            if args.kill_worker_after_samples:
                holder["killer"] = asyncio.get_running_loop().create_task(_kill_a_worker(rt, args, holder))

        error = None
        try:
            summary = await asyncio.wait_for(
                run_controller(cfg, Endpoints(urls, trainer_url), run_dir, model_dir,
                               ProcessLauncher(cfg, procs, run_dir, fixed_ports=True), log.info, None,
                               on_runtime=on_runtime),
                timeout=args.timeout_s)
        except ConfigError:
            raise  # refused at start (e.g. a concurrency the open-files limit cannot hold): exit 2
        except Exception as err:  # noqa: BLE001 - reported in the JSON, exit 1
            log.exception("controller run failed")
            error, summary = f"{type(err).__name__}: {err}", {}
        await lag.stop()
        await held.stop()
        if "at_end" in holder:
            holder["at_end"].cancel()
        t1 = time.monotonic()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        if "killer" in holder:
            holder["killer"].cancel()
        load_after = os.getloadavg()
        fleet_stats: dict[str, Any] = {}
        for f in fleets[:-1]:
            fleet_stats.update(await _get_json(f"http://127.0.0.1:{f['ports'][0]}/fleet/stats"))
        stats_file = Path(str(trainer_ready) + ".stats")  # written by the fake trainer at /shutdown
        trainer_stats = (json.loads(stats_file.read_text()) if stats_file.exists()
                         else await _get_json(f"{trainer_url}/fleet/stats"))
    ruc1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # after ProcessSet stopped and reaped them
    rt = holder.get("runtime")
    finished = rt.store.samples_finished if rt is not None else 0
    pool = getattr(next(iter(rt.engines.values()), None), "pool", None) if rt is not None else None
    worker_cpu = (pool.cpu_s() or 0.0) if pool is not None else 0.0  # measured when the pool closed
    fleet_cpu = (ruc1.ru_utime - ruc0.ru_utime) + (ruc1.ru_stime - ruc0.ru_stime) - worker_cpu  # reaped children
    killed = set(holder.get("killed_instances", ()))
    failed = set(rt.pool.failed_ever) if rt is not None else set(summary.get("failed_instances", []))
    ru0 = holder.get("ru_run", ru0)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    ru_end = holder.get("ru_end", ru1)  # the runtime's last step: before the final checkpoint, export, plots
    cpu_run = (ru_end.ru_utime - ru0.ru_utime) + (ru_end.ru_stime - ru0.ru_stime)
    run_lags_ms = [x * 1000 for x in lag.lags[:holder.get("lags_at_end", len(lag.lags))]]
    run_s = summary.get("wall_time_s") or (t1 - holder.get("t_run", t0))  # the runtime's own, without shutdown
    intervals = [x for s in fleet_stats.values() for x in s["poll_intervals"]]
    # step end -> load of the new version, per (version, instance)
    ends = {v: t for v, t in trainer_stats["step_ends"].items()}
    to_switch: dict[str, list[float]] = {}
    for s in fleet_stats.values():
        for v, t in s["loaded"]:
            if v in ends:
                to_switch.setdefault(v, []).append(t - ends[v])
    per_version_max = [max(x) for x in to_switch.values()]
    incomplete = sum(1 for n in trainer_stats["groups"].values() if n != args.group_size)
    lags_ms = [x * 1000 for x in lag.lags]
    tokens = trainer_stats.get("tokens", 0)
    reads = trainer_stats.get("reads") or []
    share = [max(r["rank_bytes"]) / (r["total_bytes"] / r["dp"]) for r in reads if r["total_bytes"]]
    array_b = 8 + (_routed_width(args.routed_experts))  # int32 id + float32 log-prob (+ int8 routed ids) per token
    totals = summary
    return {
        "instances": args.instances, "steps": args.steps, "fleet_processes": len(counts),
        "error": error,
        "steps_done": rt.training.steps_done if rt is not None else 0,
        "wall_s": run_s, "startup_s": holder.get("t_run", t1) - t0,
        "loop_lag_p50_ms": pct(lags_ms, 0.5), "loop_lag_p99_ms": pct(lags_ms, 0.99),
        "loop_lag_max_ms": max(lags_ms) if lags_ms else None, "loop_lag_samples": len(lags_ms),
        "loop_stalls": dict(sorted(lag.stalls.items(), key=lambda kv: -kv[1])),
        "gc_collections": lag.gc_report(),
        "long_stalls": lag.long_stalls,
        "gc_oldest_generation_objects_at_end": holder.get("gc_tracked_at_end"), "gc_frozen_objects": holder.get("gc_frozen"),
        # the same until the runtime ended (its last step trained): without the run's end (the last
        # checkpoint, the model's export with torch's import, the overview plot), which a short run
        # would otherwise spread over its few samples
        "run_loop_lag_p99_ms": pct(run_lags_ms, 0.99), "run_loop_lag_max_ms": max(run_lags_ms, default=None),
        "run_loop_stalls": dict(sorted(holder.get("stalls_at_end", lag.stalls).items(), key=lambda kv: -kv[1])),
        "controller_cpu_s_run": cpu_run,
        "run_cpu_s_per_1k_samples": cpu_run / holder["finished_at_end"] * 1000 if holder.get("finished_at_end") else None,
        "client_workers": cfg.rollout.client_workers,
        "controller_cpu_s": cpu, "fleet_and_trainer_cpu_s": fleet_cpu, "finished_samples": finished,
        "cpu_s_per_1k_samples": cpu / finished * 1000 if finished else None,
        # the engine-client workers (rollout.client_workers; a killed one not counted), start-up included:
        # part of the controller's cost
        "worker_cpu_s": worker_cpu, "worker_cpu_s_per_1k_samples": worker_cpu / finished * 1000 if finished else None,
        "controller_max_rss_mb": _peak_rss_mb() or ru1.ru_maxrss / 1024,
        "trained_tokens": tokens, "cpu_s_per_1k_tokens": cpu / tokens * 1000 if tokens else None,
        "peak_held_tokens": held.peak_tokens,
        "rss_growth_per_held_token_b": ((held.rss_at_peak - held.rss_at_start) / held.peak_tokens
                                        if held.peak_tokens else None),
        "rss_per_further_held_token_b": held.slope(),
        "array_bytes_per_token": array_b,
        "routed_experts": args.routed_experts or None,
        "handoff": "batch files" if reads else "json body",
        "trainer_dp": args.trainer_dp if reads else None,
        "batch_bytes_max": max((r["total_bytes"] for r in reads), default=None),
        "rank_bytes_max_over_fair_share": max(share, default=None),
        "rank_read_s_max": max((max(r["rank_read_s"]) for r in reads), default=None),
        "rank_rows_exactly_once": all(r["rows_read_once"] for r in reads) if reads else None,
        "stats_interval_s": args.stats_interval_s,
        "stats_poll_interval_p50_s": pct(intervals, 0.5), "stats_poll_interval_p99_s": pct(intervals, 0.99),
        "stats_poll_interval_max_s": max(intervals) if intervals else None,
        "stats_polls": len(intervals) + len(fleet_stats),
        "stats_polls_per_s": (len(intervals) + len(fleet_stats)) / run_s if run_s > 0 else None,
        "generate_requests": sum(s["generates"] for s in fleet_stats.values()),
        "step_end_to_switch_p50_s": pct([x for v in to_switch.values() for x in v], 0.5),
        "step_end_to_all_switched_max_s": max(per_version_max) if per_version_max else None,
        "switched_instance_loads": sum(len(v) for v in to_switch.values()),
        "false_instance_failures": len(failed - killed),
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],  # the controller's, during the run
        "controller_fds_at_start": holder.get("fds_at_start"),
        "connection_waits": totals.get("connection_waits"), "local_resource_errors": totals.get("local_resource_errors"),
        "killed_worker_pid": holder.get("killed_pid"), "killed_worker_instances": len(killed),
        "killed_worker_instances_failed": len(failed & killed),
        "killed_at_finished_samples": holder.get("killed_at"),
        "lost_groups": totals.get("lost_groups"), "duplicated_groups": totals.get("duplicated_groups"),
        "c1_violations": totals.get("c1_violations"), "c3_violations": totals.get("c3_violations"),
        "consumed_groups": totals.get("consumed_groups"),
        "trainer_groups_seen": len(trainer_stats["groups"]),
        "trainer_repeated_groups": trainer_stats["repeated_groups"],
        "trainer_incomplete_groups": incomplete,
        "fleet_nice": args.fleet_nice, "controller_cpus": sorted(args.controller_cpus),
        "others_cpus": sorted(args.others_cpus), "worker_cpus": list(holder.get("worker_cpus", {}).values()),
        "controller_cpus_seen": sorted(os.sched_getaffinity(0)), "load_average_before": list(load_before), "load_average_after": list(load_after),
        "cpu_count": os.cpu_count(),
    }


async def _at_run_end(rt, lag: LagMonitor, holder: dict[str, Any]) -> None:
    """Note the controller's CPU, its finished samples and the loop's ticks and stalls so far once
    the runtime ended (its last step done), before the run's end work."""
    await rt.tasks.ended.wait()
    holder["ru_end"] = resource.getrusage(resource.RUSAGE_SELF)
    holder["finished_at_end"] = rt.store.samples_finished
    holder["lags_at_end"] = len(lag.lags)
    holder["stalls_at_end"] = dict(lag.stalls)
    # what a full collection scans (tracked objects outside the frozen ones) against what is frozen
    holder["gc_tracked_at_end"] = len(gc.get_objects(generation=2))
    holder["gc_frozen"] = gc.get_freeze_count()


def _routed_width(spec: str) -> int:
    """Routed expert ids per token of ``--routed-experts LAYERSxTOPK`` (one byte each: int8 ids)."""
    if not spec:
        return 0
    layers, top_k = (int(x) for x in spec.lower().split("x"))
    return layers * top_k


def _open_fds() -> int | None:
    """Descriptors this process holds now (Linux ``/proc``; None elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _pin_this_process(cpus: set[int]) -> None:
    """Pin every thread of this process (Linux: one affinity per thread, threads and children made
    later inherit it) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


async def _kill_a_worker(rt, args: argparse.Namespace, holder: dict[str, Any]) -> None:
    """SIGKILL the engine-client worker of ``engine0`` once ``--kill-worker-after-samples`` samples
    finished: its instances' requests must be re-run elsewhere, none lost or run twice."""
    import signal

    while rt.store.samples_finished < args.kill_worker_after_samples:
        await asyncio.sleep(0.02)
    pid = rt.engines["engine0"].worker_pid
    holder["killed_instances"] = [iid for iid, e in rt.engines.items() if getattr(e, "worker_pid", None) == pid]
    holder["killed_pid"] = pid
    holder["killed_at"] = rt.store.samples_finished
    os.kill(pid, signal.SIGKILL)


def holds(r: dict[str, Any]) -> list[str]:
    """The invariants a run must keep (timings are reported, not judged here)."""
    bad = []
    if r["error"]:
        bad.append(f"run failed: {r['error']}")
    if r["steps_done"] != r["steps"]:
        bad.append(f"{r['steps_done']} of {r['steps']} steps done")
    for key in ("false_instance_failures", "lost_groups", "duplicated_groups", "c1_violations", "c3_violations",
                "trainer_repeated_groups", "trainer_incomplete_groups"):
        if r[key] != 0:
            bad.append(f"{key} = {r[key]}")
    if r.get("killed_worker_instances") and r["killed_worker_instances_failed"] != r["killed_worker_instances"]:
        bad.append(f"{r['killed_worker_instances_failed']} of the killed worker's {r['killed_worker_instances']} "
                   "instances were failed")
    if r["consumed_groups"] != r["trainer_groups_seen"]:
        bad.append(f"controller consumed {r['consumed_groups']} groups, the trainer saw {r['trainer_groups_seen']}")
    return bad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, required=True, help="fake SGLang instances")
    p.add_argument("--steps", type=int, required=True, help="training steps of the run")
    p.add_argument("--out", required=True, help="JSON file for the measurements")
    p.add_argument("--procs", type=int, default=0, help="processes serving the instances (0: 1 per 512, at least 1)")
    p.add_argument("--slots", type=int, default=8, help="requests per instance (rollout.max_running)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tbs", type=int, default=0, help="groups per step (0: half of the groups the pool holds)")
    p.add_argument("--rbs", type=int, default=0, help="outstanding groups (0: as many as the pool holds)")
    p.add_argument("--mode", default="dora", help="orchestrator.mode")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--per-token-s", type=float, default=0.01, help="fake decode time per token")
    p.add_argument("--min-tokens", type=int, default=8, help="scale of the Pareto response length")
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of the response length")
    p.add_argument("--load-s", type=float, default=0.05, help="fake weight load time")
    p.add_argument("--step-s", type=float, default=1.0, help="fake trainer step time")
    p.add_argument("--stats-interval-s", type=float, default=0.5, help="observability.stats_interval_s")
    p.add_argument("--lag-period-s", type=float, default=0.02)
    p.add_argument("--stall-s", type=float, default=0.25,
                   help="record where the loop is when it has not ticked for this long (0: off)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on the controller run")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="bound on the fleet's start")
    p.add_argument("--set", action="append", default=[], metavar="A.B=C", help="extra config override (repeatable)")
    p.add_argument("--fleet-nice", type=int, default=0,
                   help="run the fake engines at this niceness: they stand in for remote machines, so on a small "
                        "machine they should not take the controller's CPU (0: as the controller)")
    p.add_argument("--controller-cpus", default="",
                   help="pin the controller (this process, its event loop and threads) to these cores, e.g. 0: "
                        "on a cluster its node's cores are its own; on a small machine the fakes and workers "
                        "would otherwise take its CPU (empty: not pinned)")
    p.add_argument("--others-cpus", default="",
                   help="pin the fake fleet, the fake trainer and the client workers to these cores, e.g. 1")
    p.add_argument("--client-workers", default="",
                   help="rollout.client_workers; a comma list (e.g. 0,4) measures each in turn into one JSON ('runs')")
    p.add_argument("--kill-worker-after-samples", type=int, default=0,
                   help="SIGKILL the client worker of engine0 once this many samples finished (needs client workers)")
    p.add_argument("--controller-open-files", type=int, default=0,
                   help="lower the controller's open-files limit (soft and hard) to this once the fakes run, "
                        "to test the connection budget (0: leave it)")
    p.add_argument("--routed-experts", default="", metavar="LAYERSxTOPK",
                   help="the controller asks for routed experts (algo.router_agreement) and the fakes answer "
                        "with ids of this shape per token, e.g. 48x8")
    p.add_argument("--trainer-dp", type=int, default=8,
                   help="data-parallel ranks whose reads of each batch directory the fake trainer measures")
    p.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    args = p.parse_args(argv)
    for name in ("instances", "steps", "slots", "group_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.client_workers = [int(x) for x in args.client_workers.split(",")] if args.client_workers else [None]
    except ValueError:
        p.error(f"--client-workers must be integers separated by commas, got {args.client_workers!r}")
    have = os.sched_getaffinity(0)
    for name in ("controller_cpus", "others_cpus"):
        text = getattr(args, name)
        try:
            cpus = {int(x) for x in text.split(",")} if text else set()
        except ValueError:
            p.error(f"--{name.replace('_', '-')} must be core numbers separated by commas, got {text!r}")
        if cpus - have:
            p.error(f"--{name.replace('_', '-')}: cores {sorted(cpus - have)} are not available here "
                    f"(have {sorted(have)})")
        setattr(args, name, cpus)
    if args.routed_experts:
        try:
            _routed_width(args.routed_experts)
        except ValueError:
            p.error(f"--routed-experts must be LAYERSxTOPK, e.g. 48x8, got {args.routed_experts!r}")
    if args.kill_worker_after_samples and not all(args.client_workers):
        p.error("--kill-worker-after-samples needs --client-workers >= 1")
    args.procs = args.procs or max(1, -(-args.instances // 512))
    if args.controller_open_files < 0:
        p.error(f"--controller-open-files must be >= 0, got {args.controller_open_files}")
    if args.procs < 1 or args.procs > args.instances:
        p.error(f"--procs must be in 1..{args.instances}, got {args.procs}")
    return args


def _run_one(args: argparse.Namespace, limit: int) -> tuple[int | None, dict[str, Any]]:
    """One measured run (``args.workers_now`` client workers): (exit code if it could not run, result)."""
    work = Path(tempfile.mkdtemp(prefix="controller_scale_"))
    try:
        from dora_megatron.config.base import ConfigError

        try:
            result = asyncio.run(measure(args, work))
        except ConfigError as err:
            sys.stderr.write(f"config error: {err}\n")
            return 2, {}
        except (TimeoutError, OSError, RuntimeError) as err:  # the fake fleet or trainer never came up
            sys.stderr.write(f"controller_scale: {type(err).__name__}: {err} (written to {args.out})\n")
            return 1, {"instances": args.instances, "error": f"{type(err).__name__}: {err}",
                       "invariant_violations": [f"run failed: {err}"]}
    finally:
        if args.keep:
            sys.stderr.write(f"run directory kept: {work}\n")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result.setdefault("open_files_limit", limit)
    result["invariant_violations"] = holds(result)
    return None, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limit = raise_fd_limit()
    need = args.instances * (args.slots + 2) + 256
    if limit < need:  # the controller sizes its pools from the limit: requests wait (connection_waits)
        log.warning("open-files limit %d is below one socket per request for %d instances x %d slots (about "
                    "%d): requests will wait for connections", limit, args.instances, args.slots, need)
    runs = []
    for workers in args.client_workers:
        args.workers_now = workers
        code, result = _run_one(args, limit)
        if code == 2:
            return 2
        runs.append(result)
    out: dict[str, Any] = runs[0] if len(runs) == 1 else {
        "runs": runs, "invariant_violations": [f"client_workers={r.get('client_workers')}: {v}"
                                               for r in runs for v in r["invariant_violations"]]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    keys = ("instances", "client_workers", "wall_s", "loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms",
            "run_loop_lag_p99_ms", "run_loop_lag_max_ms", "cpu_s_per_1k_samples", "run_cpu_s_per_1k_samples", "worker_cpu_s_per_1k_samples", "stats_poll_interval_p50_s",
            "stats_poll_interval_p99_s", "step_end_to_all_switched_max_s", "controller_max_rss_mb",
            "false_instance_failures", "connection_waits", "local_resource_errors", "lost_groups",
            "duplicated_groups", "c1_violations", "c3_violations")
    for result in runs:
        for k in keys:
            v = result.get(k)
            sys.stdout.write(f"{k}: {v:.3f}\n" if isinstance(v, float) else f"{k}: {v}\n")
    for problem in out["invariant_violations"]:
        sys.stdout.write(f"VIOLATION: {problem}\n")
    return 1 if out["invariant_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
