"""Many lightweight SGLang-protocol fake engines (or one fake trainer) in one process, for the
controller load harness (``tools/controller_scale.py``).

WHY fakes, and why many per process: the harness measures the controller (its event loop, HTTP
clients, stats polling, journal), not an engine, so an instance here is a few dictionaries behind
its own loopback port: ``/generate`` answers after ``tokens * per_token_s`` with a token count
drawn from a long-tailed (Pareto) distribution seeded by the request's ``sampling_seed``, so a
rerun draws the same lengths. One aiohttp application serves every port of the process and
finds the instance by the local port of the connection, so 1,000 instances cost one process.

The surface is the one :class:`~dora_megatron.comm.sglang_client.SGLangClient` speaks:
``/health``, ``/v1/loads``, ``/model_info``, ``/generate`` (with ``meta_info.weight_versions``),
``/abort_request`` (rid prefix or all, 200 with an empty body), ``/pause_generation``,
``/continue_generation``, ``/flush_cache``, ``/update_weights_from_disk``, ``/weights_checker``.
``/fleet/stats`` (on the first port) returns what the harness measures from the engines' side:
poll intervals per instance and when each instance finished loading each version.

``--role trainer``: a fake trainer service (``/health``, ``/train`` after ``--step-s``,
``/save_checkpoint``, ``/shutdown``: the counts go to ``READY.stats``, then it exits) that also counts, independently of the controller, every
group it is given (``/fleet/stats``): a group seen twice or with a missing sample is reported.

Every wait is bounded; the process writes its ports to ``--ready FILE`` (atomically) once it
listens and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import logging
import os
import random
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

log = logging.getLogger("fake_fleet")

#: bytes one write of a streamed answer hands aiohttp (it waits for the socket to drain between
#: writes): what each unread answer holds here beyond the kernel's socket buffer. WHY this small:
#: 4,096 answers waiting on a busy controller held 4 GB here at 1 MiB a write
ANSWER_CHUNK = 64 << 10
#: the kernel send buffer of each of the fleet's sockets (see :func:`_listen`)
SEND_BUFFER = 16 << 10


def _token_id() -> int:
    """A digit of the preset character vocabulary: decodable, never EOS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dora_megatron.data import tokenizer as tok

    return tok.encode("7")[0]


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (each instance is a listening socket plus
    its connections); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def draw_tokens(seed: int, min_tokens: int, alpha: float, max_tokens: int) -> int:
    """Long-tailed response length: Pareto(alpha) scaled by ``min_tokens``, capped at ``max_tokens``."""
    rng = random.Random(seed)
    return max(1, min(max_tokens, int(min_tokens * rng.paretovariate(alpha))))


@dataclass
class _Running:
    prompt_tokens: int
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Instance:
    version: str = "0"
    running: dict[str, _Running] = field(default_factory=dict)
    last_poll: float | None = None
    poll_intervals: list[float] = field(default_factory=list)
    loaded: list[tuple[str, float]] = field(default_factory=list)  # (version, wall time the load ended)
    generates: int = 0


class Fleet:
    """Instances keyed by their port; ``per_token_s`` etc. shape the fake generation."""

    def __init__(self, ports: list[int], per_token_s: float, min_tokens: int, alpha: float, load_s: float,
                 pool_tokens: int, routed: tuple[int, int] | None = None, num_experts: int = 128,
                 max_tokens: int = 32768) -> None:
        self.instances = {p: _Instance() for p in ports}
        self.first_port = ports[0]
        self.per_token_s = per_token_s
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.load_s = load_s
        self.pool_tokens = pool_tokens
        self.paused: dict[int, asyncio.Event] = {}
        self.token = _token_id()
        rng = random.Random(0)
        self.lp_pool = [round(-rng.expovariate(4.0), 6) for _ in range(65536)]
        self.routed = routed  # (layers, top_k) of the answers' routed experts; None: never sent
        if routed is not None:  # a pool as long as the longest answer: windows of it are every answer's
            draws = np.frombuffer(rng.randbytes(max_tokens * routed[0] * routed[1]), dtype=np.uint8)
            self.routed_pool = (draws % num_experts).astype("<i4").tobytes()
            # encoded once: an answer's base64 is a slice of it (what SGLang's GPU side costs is not
            # this process's to pay; encoding ~60 MB per long answer here starved the fleet's own
            # /server_info answers at 64 instances)
            self.routed_pool_b64 = base64.b64encode(self.routed_pool)

    def inst(self, request: web.Request) -> _Instance:
        return self.instances[request.transport.get_extra_info("sockname")[1]]

    async def generate(self, request: web.Request) -> web.Response:
        port = request.transport.get_extra_info("sockname")[1]
        inst = self.instances[port]
        body = await request.json()
        rid = str(body.get("rid") or f"anon-{inst.generates}")
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 64))
        seed = int(sp.get("sampling_seed", 0) or 0)
        inst.generates += 1
        gate = self.paused.get(port)
        if gate is not None:
            await asyncio.wait_for(gate.wait(), timeout=600)
        version = inst.version
        want = draw_tokens(seed, self.min_tokens, self.alpha, max_new)
        state = _Running(len(body.get("input_ids") or ()))
        inst.running[rid] = state
        start = time.monotonic()
        try:
            await asyncio.wait_for(state.aborted.wait(), timeout=want * self.per_token_s)
            n = min(want, int((time.monotonic() - start) / self.per_token_s))
            reason: dict[str, Any] = {"type": "abort", "message": "aborted"}
        except asyncio.TimeoutError:
            n = want
            reason = {"type": "length", "length": n} if n == max_new else {"type": "stop", "matched": self.token}
        finally:
            inst.running.pop(rid, None)
        lps = self.logprobs(seed, n)
        meta = {
            "id": rid, "finish_reason": reason, "prompt_tokens": state.prompt_tokens, "completion_tokens": n,
            "weight_version": version, "weight_versions": [{"version": version, "start": 0, "end": n}],
            "output_token_logprobs": [[lp, self.token, None] for lp in lps],
        }
        routed = None
        if body.get("return_routed_experts") and self.routed is not None:  # SGLang: prompt + output - 1 positions
            start = int(body.get("routed_experts_start_len") or 0)
            routed = self.routed_experts(seed, state.prompt_tokens + n - 1 - start)
        pieces = self.answer(n, meta, routed)
        if routed is None:
            return web.Response(body=pieces[0], content_type="application/json")
        # streamed: each write waits while the controller has not read the last ones, as a real
        # server's socket would make it (written whole, unread answers piled up in this process
        # until the kernel killed it: 19 GB at 64 instances x 64 slots with 48x8 routed experts)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = sum(len(p) for p in pieces)
        await resp.prepare(request)
        for piece in pieces:
            view = memoryview(piece)
            for i in range(0, len(view), ANSWER_CHUNK):
                await resp.write(view[i:i + ANSWER_CHUNK])
        await resp.write_eof()
        return resp

    def answer(self, n: int, meta: dict[str, Any], routed: list[bytes | memoryview] | None) -> list[bytes | memoryview]:
        """The ``/generate`` answer's JSON, in pieces: ``n`` output ids, ``meta`` and, when given,
        the routed experts' base64 pieces as ``meta_info.routed_experts``, spliced in as bytes
        (``json.dumps`` would scan and copy the tens of MB of a long answer's base64 again)."""
        text = json.dumps({"output_ids": [self.token] * n, "meta_info": meta}).encode()
        if routed is None:
            return [text]
        return [text[:-2], b', "routed_experts": "', *routed, b'"}}']

    def logprobs(self, seed: int, n: int) -> list[float]:
        """``n`` distinct log-probs (a window of a fixed pool of exponential draws, by the request's
        seed): JSON and arrays cost what a real answer's do, not what ``-0.5`` repeated costs."""
        pool = self.lp_pool
        start = seed % len(pool)
        out = pool[start:start + n]
        while len(out) < n:
            out += pool[:n - len(out)]
        return out

    def routed_experts(self, seed: int, positions: int) -> list[bytes | memoryview]:
        """SGLang's ``meta_info.routed_experts`` text for ``positions`` tokens, in pieces: base64 of
        int32 ids ``(positions, layers, top_k)``, a window of a fixed pool of random ids below the
        expert count.

        The window starts at a multiple of three positions (a whole number of base64 quanta), so
        its text is a view of the pool's text (no copy of a long answer's ~60 MB); only the last,
        partial quantum is encoded here."""
        width = 4 * self.routed[0] * self.routed[1]
        need = min(max(0, positions) * width, len(self.routed_pool))
        room = (len(self.routed_pool) - need) // (3 * width)
        start = (seed % (room + 1)) * 3 * width
        whole = need - need % 3
        head = memoryview(self.routed_pool_b64)[start // 3 * 4:(start + whole) // 3 * 4]
        tail = base64.b64encode(self.routed_pool[start + whole:start + need]) if need % 3 else b""
        return [head, tail]

    async def abort_request(self, request: web.Request) -> web.Response:
        inst = self.inst(request)
        body = await request.json()
        rid, everything = str(body.get("rid") or ""), bool(body.get("abort_all"))
        for key, state in list(inst.running.items()):
            if everything or (rid and key.startswith(rid)):
                state.aborted.set()
        return web.Response(status=200, body=b"")

    async def loads(self, request: web.Request) -> web.Response:
        inst = self.inst(request)
        now = time.monotonic()
        if inst.last_poll is not None:
            inst.poll_intervals.append(now - inst.last_poll)
        inst.last_poll = now
        used = sum(r.prompt_tokens for r in inst.running.values())
        load = {"dp_rank": 0, "num_running_reqs": len(inst.running), "num_waiting_reqs": 0,
                "num_used_tokens": used, "num_total_tokens": used, "max_total_num_tokens": self.pool_tokens,
                "token_usage": used / self.pool_tokens}
        return web.json_response({"version": "0.5.23", "loads": [load]})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.inst(request).version, "model_path": "fake"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        inst = self.inst(request)
        body = await request.json()
        await asyncio.sleep(self.load_s)
        if body.get("weight_version") is not None:
            inst.version = str(body["weight_version"])
        inst.loaded.append((inst.version, time.time()))
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def weights_checker(self, request: web.Request) -> web.Response:
        digest = hashlib.sha256(self.inst(request).version.encode()).hexdigest()
        return web.json_response({"success": True, "message": "ok", "per_engine_checksum": digest})

    async def pause_generation(self, request: web.Request) -> web.Response:
        self.paused.setdefault(request.transport.get_extra_info("sockname")[1], asyncio.Event())
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        gate = self.paused.pop(request.transport.get_extra_info("sockname")[1], None)
        if gate is not None:
            gate.set()
        return web.json_response({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({str(p): {"poll_intervals": i.poll_intervals, "loaded": i.loaded,
                                           "generates": i.generates} for p, i in self.instances.items()})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/model_info", self.model_info)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/weights_checker", self.weights_checker)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/fleet/stats", self.stats)
        return app


def read_as_ranks(entry: dict[str, Any], dp: int) -> dict[str, Any]:
    """Read a batch directory as each of ``dp`` data-parallel ranks does (the trainer's own plan
    picks a rank's rows from the lengths; :class:`~dora_megatron.comm.batch_files.BatchReader`
    copies out only those): bytes and seconds per rank, and the whole batch's bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dora_megatron.comm.batch_files import BatchReader, decode_batch
    from dora_megatron.trainer.packing import plan_step

    lengths = [s["prompt_tokens"] + s["response_tokens"] for s in entry["samples"]]
    per_rank, seconds, rows_seen = [], [], []
    for rank in range(dp):
        t0 = time.monotonic()
        reader = BatchReader(decode_batch(entry))
        plan = plan_step(lengths, dp=dp, dp_rank=rank, micro_batch_size=1, max_tokens=max(max(lengths), 16384))
        rows = sorted({i for mb in plan.micro_batches for i in mb.rows if i >= 0})
        reader.samples(rows)
        seconds.append(time.monotonic() - t0)
        per_rank.append(reader.bytes_read)
        rows_seen += rows
    total = sum(f.stat().st_size for f in Path(entry["dir"]).glob("*.npy"))
    # routed experts the controller spooled as the samples finished (comm.routed_spool): part of the
    # batch, read by the ranks from the spool, not from the directory
    total += sum(v.nbytes for v in reader.spooled.values())
    return {"dp": dp, "total_bytes": total, "rank_bytes": per_rank, "rank_read_s": seconds,
            "rows_read_once": sorted(rows_seen) == list(range(len(lengths)))}


class FakeTrainer:
    """``/train`` sleeps ``step_s`` and returns version ``step + 1``; counts groups independently."""

    def __init__(self, step_s: float, run_dir: Path, stats_path: Path, dp: int = 8) -> None:
        self.step_s = step_s
        self.dp = dp
        self.reads: list[dict[str, Any]] = []  # per step: what each DP rank read of its batch directory
        self.tokens = 0  # prompt + response tokens of every sample trained on
        self.run_dir = run_dir
        self.version = 0
        self.groups: dict[str, int] = {}  # group id -> samples received
        self.repeated_groups = 0
        self.step_ends: dict[str, float] = {}  # new version -> wall time the step ended
        self.stats_path = stats_path
        self.stop = asyncio.Event()

    async def train(self, request: web.Request) -> web.Response:
        body = await request.json()
        step = int(body["step"])
        if step != self.version:
            return web.json_response({"error": f"step {step} does not match version {self.version}"}, status=400)
        per_group: dict[str, int] = {}
        if "batch" in body:  # a batch directory: read it as each DP rank of a real trainer would
            self.reads.append(await asyncio.to_thread(read_as_ranks, body["batch"], self.dp))
            self.tokens += sum(s["prompt_tokens"] + s["response_tokens"] for s in body["batch"]["samples"])
        else:
            self.tokens += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in body["samples"])
        for s in body["batch"]["samples"] if "batch" in body else body["samples"]:
            per_group[s["group_id"]] = per_group.get(s["group_id"], 0) + 1
        for gid, n in per_group.items():
            if gid in self.groups:
                self.repeated_groups += 1
            self.groups[gid] = self.groups.get(gid, 0) + n
        await asyncio.sleep(self.step_s)
        self.version += 1
        snapshot = self.run_dir / "weights" / f"v{self.version:06d}"
        snapshot.mkdir(parents=True, exist_ok=True)
        self.step_ends[str(self.version)] = time.time()
        return web.json_response({"version": self.version, "metrics": {"loss": 0.0}, "snapshot": str(snapshot)})

    async def save_checkpoint(self, request: web.Request) -> web.Response:
        path = Path((await request.json())["path"])
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.txt").write_text(f"version {self.version}\n")
        return web.json_response({"path": str(path), "version": self.version})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "version": self.version, "world_size": 1})

    async def shutdown(self, request: web.Request) -> web.Response:
        """Write the counts to ``stats_path`` (the harness reads them after the run), then exit as
        the real trainer does (the launcher waits for that)."""
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.counts()))
        tmp.rename(self.stats_path)
        asyncio.get_running_loop().call_later(0.2, self.stop.set)
        return web.json_response({"ok": True})

    def counts(self) -> dict[str, Any]:
        return {"groups": self.groups, "repeated_groups": self.repeated_groups, "step_ends": self.step_ends,
                "reads": self.reads, "tokens": self.tokens}

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.counts())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/train", self.train)
        app.router.add_post("/save_checkpoint", self.save_checkpoint)
        app.router.add_post("/shutdown", self.shutdown)
        app.router.add_get("/health", self.health)
        app.router.add_get("/fleet/stats", self.stats)
        return app


def _listen(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # WHY: here one kernel holds both ends of every connection, and the answers' send buffers
        # (autotuned to MBs each) would count against the controller's host; a real engine's
        # answer waits in its own host's kernel. Accepted sockets inherit this.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        s.bind(("127.0.0.1", 0))
        s.listen(1024)
        s.setblocking(False)
        socks.append(s)
    return socks


async def serve(args: argparse.Namespace) -> None:
    raise_fd_limit()
    socks = _listen(1 if args.role == "trainer" else args.instances)
    ports = [s.getsockname()[1] for s in socks]
    stop = asyncio.Event()
    if args.role == "trainer":
        trainer = FakeTrainer(args.step_s, Path(args.run_dir), Path(args.ready + ".stats"), args.dp)
        app, stop = trainer.app(), trainer.stop
    else:
        routed = tuple(int(x) for x in args.routed_experts.lower().split("x")) if args.routed_experts else None
        app = Fleet(ports, args.per_token_s, args.min_tokens, args.alpha, args.load_s, args.pool_tokens,
                    routed, args.num_experts, args.max_tokens).app()
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    for s in socks:
        await web.SockSite(runner, s, backlog=1024).start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tmp = Path(args.ready + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "ports": ports}))
    tmp.rename(args.ready)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("engines", "trainer"), default="engines")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--ready", required=True, help="file to write {pid, ports} to once listening")
    p.add_argument("--per-token-s", type=float, default=0.005)
    p.add_argument("--min-tokens", type=int, default=8, help="scale of the Pareto length distribution")
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto shape (smaller: longer tail)")
    p.add_argument("--load-s", type=float, default=0.05, help="seconds one weight load takes")
    p.add_argument("--pool-tokens", type=int, default=8192, help="KV pool size reported by /v1/loads")
    p.add_argument("--routed-experts", default="", metavar="LAYERSxTOPK",
                   help="answer requests that ask for routed experts with ids of this shape per token, e.g. 48x8")
    p.add_argument("--num-experts", type=int, default=128, help="expert count of the routed ids (--routed-experts)")
    p.add_argument("--max-tokens", type=int, default=32768, help="longest prompt + answer (--routed-experts' pool)")
    p.add_argument("--step-s", type=float, default=1.0, help="trainer: seconds one training step takes")
    p.add_argument("--dp", type=int, default=8, help="trainer: data-parallel ranks whose reads of a batch "
                                                     "directory are measured")
    p.add_argument("--run-dir", default=".", help="trainer: where snapshot directories are made")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
