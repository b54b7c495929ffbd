"""The eval set (``data.eval_path``), answered on the rollout engines while the run trains.

Why on the engines, beside the rollout: the engines already hold the weights being evaluated and
generate far faster than a reference implementation; the eval's requests go through the same
engine clients (``Engine.generate``) the rollout's do, with the rollout's sampling parameters and
stop tokens, and are scored by the run's reward scorer. The orchestrator does not schedule them:
they share the engines' slots with the rollout (at most ``slots`` of them per engine at a time),
and neither the trainer nor a weight switch waits for them. The trainer therefore never stalls
for an eval; the rollout only loses the engine time the eval borrows.

Why a switch first sends the eval's requests away: a weight load waits for the requests an engine
runs (the embedded engine loads when idle, SGLang behind its model-update lock), so before an
instance switches the runtime calls :meth:`Evaluator.vacate`: no eval request goes there until the
switch landed, and those on it are aborted and asked again elsewhere (or there, on the new
weights, when the round's step allows). Why each sample is tagged with one version and retried:
an engine may still switch weights under a request the orchestrator does not know about. Every eval request carries the version the engine
holds (its C1 guard refuses it after a switch); an answer that was aborted (a pause, the shutdown
of the rollout's requests) or that says more than one version produced its tokens is asked
again, so every sample of a round comes from one version. A round of step ``s`` uses engines
holding version ``s`` or newer (they switch on the orchestrator's schedule); the round records
which versions answered. The final round runs after the last step, when the rollout has stopped,
on every engine switched to the final weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.controller.records import Engine
from dora_megatron.data.codec import TextCodec
from dora_megatron.data.reward_api import RewardScorer, reward_input
from dora_megatron.data.tasks import Prompt
from dora_megatron.observability.eval_metrics import eval_scalars, round_metrics

if TYPE_CHECKING:
    from dora_megatron.comm.protocol import GenerateResponse
    from dora_megatron.controller.pool import Pool
    from dora_megatron.controller.weight_sync import WeightSync
    from dora_megatron.observability.tensorboard import ScalarWriter

log = logging.getLogger(__name__)

#: attempts of one eval sample (aborted, version-refused, unreachable engine) before the round fails
MAX_ATTEMPTS = 200
#: tries of the final round's weight load of one engine
LOAD_ATTEMPTS = 4


class EvalRoundFailed(RuntimeError):
    """A round could not be completed (no engine answered one of its samples)."""


class Evaluator:
    """Runs eval rounds of ``prompts`` (:class:`~dora_megatron.data.tasks.Prompt`) on the rollout
    ``engines``; ``scorer``: the run's :class:`~dora_megatron.data.reward_api.RewardScorer`;
    ``codec``: the one renderer of prompts and answers; ``pool``: which instances failed, which
    version each holds; ``weights``: the final round's weight loads. ``observability``: the
    config's section (``eval_interval``, ``eval_samples``, ``eval_pass_threshold``); ``rollout`` and
    ``seed`` (``run.seed``): each eval sample is drawn as the rollout's are. ``slots``: eval requests
    one instance runs at once. ``sinks``: scalar writers (TensorBoard, W&B) that get ``eval/...`` at
    the step evaluated; ``out``: ``eval.jsonl`` (one line per round); ``path``: ``data.eval_path``, for the summary."""

    def __init__(self, prompts: Sequence[Prompt], scorer: RewardScorer, *, engines: dict[str, Engine],
                 pool: Pool, weights: WeightSync, codec: TextCodec, observability: ObservabilityConfig,
                 rollout: RolloutConfig, seed: int, slots: int, sinks: Sequence[ScalarWriter] = (), out: Path | None = None,
                 path: str = "") -> None:
        if not prompts:
            raise ValueError("data.eval_path: no usable rows")
        self.engines = engines
        self.pool = pool
        self.weights = weights
        self.codec = codec
        self.prompts = list(prompts)
        self.prompt_ids = [codec.encode_prompt(p) for p in self.prompts]  # the one renderer
        self.scorer = scorer
        self.samples = observability.eval_samples
        self.interval = observability.eval_interval
        self.threshold = observability.eval_pass_threshold
        self.rollout = rollout
        self.seed = seed
        self.slots = max(1, slots)
        self.sinks = list(sinks)
        self.out = out
        self.path = path
        self.rounds: list[dict[str, Any]] = []
        self.reward_errors = 0
        self._in_flight: dict[str, int] = {}  # instance -> eval requests on it now
        self._requests: dict[str, dict[str, asyncio.Task[GenerateResponse]]] = {}  # instance -> rid -> its /generate
        self._closed: dict[str, int] = {}  # instance -> switches of it under way: no eval request goes there
        self._pending: list[asyncio.Task[dict[str, Any] | None]] = []
        self._ending = False
        #: instance -> the version the final round loaded there (the rollout has stopped: the
        #: orchestrator no longer follows what the instances hold)
        self._final_loads: dict[str, int] = {}

    # ------------------------------------------------------------------ when
    def after_step(self, step: int, version: int, last: bool) -> None:
        """``step`` steps are done (their weights: ``version``): start a round when one is due. The
        last step's round is :meth:`finish`'s. Rounds are numbered by the steps done, which is the
        TensorBoard step they are written at (as the held-out rates are: the final weights of an
        N-step run at N)."""
        if self.interval and step % self.interval == 0 and not last:
            task = asyncio.get_running_loop().create_task(self._round(step, version, final=False),
                                                          name=f"eval-{step}")
            self._pending.append(task)

    async def finish(self, step: int, version: int) -> None:
        """After the last step (the rollout has stopped): switch every live engine to ``version``,
        let the rounds still running end, then evaluate the final weights."""
        await self._switch_all(version)
        self._ending = True  # no switch will come: a round no engine can serve ends instead of waiting
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._round(step, version, final=True)

    async def vacate(self, instances: Sequence[str]) -> None:
        """``instances`` are about to load weights: send them no eval request until :meth:`reopen`,
        and abort the eval requests on them until each has returned (they are asked again)."""
        from dora_megatron.controller.migration import abort_until_returned

        for iid in instances:
            self._closed[iid] = self._closed.get(iid, 0) + 1
        waits = [abort_until_returned(self.engines[iid], rid, task) for iid in instances if iid in self.engines
                 for rid, task in list(self._requests.get(iid, {}).items())]
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    def reopen(self, instance: str) -> None:
        """The switch of ``instance`` ended (landed or failed): eval requests may go there again."""
        left = self._closed.get(instance, 0) - 1
        if left > 0:
            self._closed[instance] = left
        else:
            self._closed.pop(instance, None)

    def cancel(self) -> None:
        """The run failed: drop the rounds still running."""
        for task in self._pending:
            task.cancel()

    # ------------------------------------------------------------------ a round
    async def _round(self, step: int, version: int, *, final: bool) -> dict[str, Any] | None:
        start = time.monotonic()
        try:
            results = await asyncio.gather(*(self._prompt(step, version, i) for i in range(len(self.prompts))))
        except EvalRoundFailed as err:
            log.warning("eval round of step %d not done: %s", step, err)
            return None
        except Exception:  # noqa: BLE001 - an eval is not worth failing the run (or its end)
            log.exception("eval round of step %d failed", step)
            return None
        rewards = [[r for r, _ in per] for per in results]
        versions = sorted({v for per in results for _, v in per})
        record = {"step": step, "version": version, "versions": versions, "final": final,
                  **round_metrics(rewards, self.samples, self.threshold),
                  "duration_s": round(time.monotonic() - start, 3)}
        self.rounds.append(record)
        for sink in self.sinks:
            sink.scalars(step, eval_scalars(record))
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        log.info("eval step %d (weights v%s): mean reward %.3f, pass@1 %.3f, pass@%d %.3f (%d prompts, %.1f s)",
                 step, "/".join(map(str, versions)), record["mean_reward"], record["pass@1"], self.samples,
                 record["pass@k"], record["prompts"], record["duration_s"])
        return record

    async def _prompt(self, step: int, version: int, i: int) -> list[tuple[float, int]]:
        """``samples`` answers of prompt ``i``, each (reward, version that produced it)."""
        return list(await asyncio.gather(*(self._sample(step, version, i, j) for j in range(self.samples))))

    async def _sample(self, step: int, min_version: int, i: int, j: int) -> tuple[float, int]:
        ids, text, version = await self._generate(step, min_version, i, j)
        result = await self.scorer.score(reward_input(self.prompts[i], text))
        if result.error:
            self.reward_errors += 1
            if self.reward_errors == 1:
                log.warning("eval reward error (reward 0; later ones are counted): %s\n%s", result.error,
                            result.traceback or "")
        return float(result.score), version

    async def _generate(self, step: int, min_version: int, i: int, j: int) -> tuple[list[int], str, int]:
        from dora_megatron.comm.engine_client import VersionMismatch
        from dora_megatron.controller.errors import is_comm_error

        seed = zlib.crc32(f"{self.seed}/eval/{step}/{i}/{j}".encode()) & 0x7FFFFFFF
        sampling = {"max_new_tokens": self.rollout.max_new_tokens, "temperature": self.rollout.temperature,
                    "top_p": self.rollout.top_p, "top_k": self.rollout.top_k, "sampling_seed": seed,
                    "stop_token_ids": list(dict.fromkeys([*self.codec.eos_ids, *self.rollout.stop_token_ids]))}
        last_problem = "no engine held the weights"
        for attempt in range(MAX_ATTEMPTS):
            iid, version = await self._engine(min_version)
            engine = self.engines[iid]
            rid = f"eval/{step}/{i}/{j}/{attempt}/"  # no rid is a prefix of another (aborts match prefixes)
            self._in_flight[iid] = self._in_flight.get(iid, 0) + 1
            task = asyncio.get_running_loop().create_task(engine.generate(
                self.prompt_ids[i], sampling, rid=rid, return_logprob=False, version=version))
            self._requests.setdefault(iid, {})[rid] = task  # what vacate() aborts and waits for
            try:
                resp = await task
            except VersionMismatch as err:  # it switched since it was picked; its SwitchDone follows
                last_problem = f"{iid}: {err}"
                await asyncio.sleep(0.05)
                continue
            except Exception as err:  # noqa: BLE001
                if not is_comm_error(err):
                    raise
                last_problem = f"{iid}: {err}"
                await asyncio.sleep(0.2)  # the runtime's health checks fail or restart it meanwhile
                continue
            finally:
                self._in_flight[iid] -= 1
                self._requests[iid].pop(rid, None)
            used = {str(v) for v in resp.versions_used if str(v)}
            if (resp.finish_reason or {}).get("type") == "abort" or len(used) > 1:
                last_problem = f"{iid}: the answer was aborted or crossed a weight switch"
                continue
            return list(resp.output_ids), self.codec.decode(resp.output_ids), version
        raise EvalRoundFailed(f"prompt {i} sample {j}: {MAX_ATTEMPTS} attempts ({last_problem})")

    def _version(self, iid: str) -> int:
        """The weights ``iid`` holds: the orchestrator's view (-1: none yet), or the final round's load."""
        if iid in self._final_loads:
            return self._final_loads[iid]
        v = self.pool.instance_version(iid)
        return -1 if v is None else v

    async def _engine(self, min_version: int) -> tuple[str, int]:
        """A live engine holding ``min_version`` or newer with an eval slot free (the one with the
        fewest eval requests), and its version; waits until there is one."""
        while True:
            ready = [(self._in_flight.get(iid, 0), iid) for iid in list(self.engines)
                     if iid not in self._closed and not self.pool.is_failed(iid)
                     and self._version(iid) >= min_version and self._in_flight.get(iid, 0) < self.slots]
            if ready:
                iid = min(ready)[1]
                return iid, self._version(iid)
            if self._ending and not any(not self.pool.is_failed(iid) and self._version(iid) >= min_version
                                        for iid in list(self.engines)):
                raise EvalRoundFailed(f"no live engine holds v{min_version} or newer")
            await asyncio.sleep(0.05)

    async def _switch_all(self, version: int) -> None:
        """Every live engine onto ``version`` (its snapshot), before the final round. An engine that
        cannot load it keeps its weights (and answers only rounds of older steps)."""

        async def one(iid: str) -> None:
            if self._version(iid) == version:
                return
            await self.vacate([iid])  # rounds of older steps still running there (a load waits for them)
            try:
                for attempt in range(LOAD_ATTEMPTS):  # the rollout's aborted requests may take a moment to leave
                    try:
                        bad = await self.weights.load_weights(self.engines[iid], version, instance=iid)
                        break
                    except Exception as err:  # noqa: BLE001 - the eval is not worth failing a finished run
                        if attempt == LOAD_ATTEMPTS - 1:
                            log.warning("eval: %s could not load v%d for the final round: %s", iid, version, err)
                            return
                        await asyncio.sleep(0.2 * (attempt + 1))
            finally:
                self.reopen(iid)
            if bad is not None:
                log.warning("eval: %s loaded v%d wrongly (%s); it takes no part in the final round", iid, version, bad)
                return
            self._final_loads[iid] = version

        await asyncio.gather(*(one(iid) for iid in list(self.engines) if not self.pool.is_failed(iid)))

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        """``summary.json``'s eval fields: the final round's figures, every round of this process."""
        final = next((r for r in reversed(self.rounds) if r["final"]), None)
        return {
            "eval_path": self.path, "eval_prompts": len(self.prompts), "eval_samples": self.samples,
            "eval_mean_reward": final["mean_reward"] if final else None,
            "eval_pass@1": final["pass@1"] if final else None,
            "eval_pass@k": final["pass@k"] if final else None,
            "eval_reward_errors": self.reward_errors,
            "eval_rounds": list(self.rounds),
        }
