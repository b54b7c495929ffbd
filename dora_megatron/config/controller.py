"""The runtime controller's own knobs (the orchestrator's policy lives in ``orchestrator``)."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class ControllerConfig:
    migration: str = field_doc("kv", "How a `Migrate` is executed: `kv` exports state + KV blocks and imports them "
                               "elsewhere (zero re-prefill; falls back automatically on engines without the "
                               "extension, e.g. SGLang); `reprefill` always aborts and resubmits prompt + partial "
                               "output (the SGLang path; an ablation).", choices=("kv", "reprefill"))
    health_timeout_s: float = field_doc(30.0, "An engine whose stats poll (`/v1/loads` on SGLang, "
                                        "`/get_server_info` otherwise) does not answer within this time twice in a "
                                        "row is treated as failed (one timeout can be the controller's own loop lag).", gt=0.0, unit="s")
    verify_checksums: bool = field_doc(True, "After a weight load, check the instance's weights: the embedded engine's "
                                       "checksum against the trainer's export checksum, an SGLang instance's "
                                       "/weights_checker checksum against the other instances on the same version "
                                       "(off under EPLB); a mismatch fails the instance.")
    weight_transport: str = field_doc("disk", "How a new version reaches the instances switching to it right after "
                                      "a training step: `disk` loads the per-version safetensors snapshot "
                                      "(`/update_weights_from_disk`); `distributed` has the trainer broadcast it "
                                      "in buckets over a torch.distributed group (`/update_weights_from_distributed`, "
                                      "gloo on CPU, NCCL on GPU). Instances switching later to an older live "
                                      "version always load its snapshot.", choices=("disk", "distributed"))
    bucket_mb: float = field_doc(256.0, "Largest bucket of the `distributed` weight transport (a bigger tensor is "
                                 "sent alone).", gt=0.0, unit="MB")
    weight_sync_timeout_s: float = field_doc(600.0, "Bound on one instance's weight update (snapshot load plus "
                                             "checksum check); an instance that has not finished within it is "
                                             "treated as failed (its requests re-run on another instance of the "
                                             "same version, training goes on). The `distributed` transport passes "
                                             "it to the trainer as the broadcast timeout; a failed broadcast falls "
                                             "back to the snapshot path.", gt=0.0, unit="s")
    journal: bool = field_doc(True, "Write-ahead journal `RUN_DIR/journal.jsonl` (with `run.checkpoint_interval` > 0): "
                              "every dispatch and every finished sample (tokens, log-probs, reward) after the last "
                              "checkpoint, flushed per line; `--resume` restores the finished samples it may "
                              "(generated in one piece by a version <= the checkpoint's) instead of regenerating "
                              "them, listed in `RUN_DIR/replayed.jsonl`.")
    stop_checkpoint_timeout_s: float = field_doc(300.0, "On the first SIGINT, SIGTERM or SIGUSR1 (Ctrl-C, `kill`, "
                                                 "`scancel`, SLURM's early warning) the job writes a checkpoint at "
                                                 "the next step boundary and exits, whatever `run.checkpoint_interval` "
                                                 "says; if that boundary does not come within this time, the step is "
                                                 "abandoned and the job exits keeping the last complete checkpoint "
                                                 "(`--resume` redoes the steps after it). A second signal exits at once.",
                                                 gt=0.0, unit="s")
    trainer_timeout_s: float = field_doc(60.0, "The trainer counts as lost when its `/health` has not answered for "
                                         "this long (it answers during a step, so only a dead, hung or "
                                         "unreachable trainer stays silent); a trainer process of this launcher "
                                         "that exits, or a call it drops, counts at once. A lost trainer is "
                                         "restarted from the last complete checkpoint under "
                                         "`launch.max_trainer_restarts` (local and SLURM jobs).", gt=0.0, unit="s")
