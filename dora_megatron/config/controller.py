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
    health_timeout_s: float = field_doc(30.0, "An engine whose `/get_server_info` does not answer within this "
                                        "time is treated as failed.", gt=0.0, unit="s")
    verify_checksums: bool = field_doc(True, "After a weight load, compare the engine's weights checksum with the "
                                       "trainer's export checksum; a mismatch fails the instance.")
    weight_transport: str = field_doc("disk", "How a new version reaches the instances switching to it right after "
                                      "a training step: `disk` loads the per-version safetensors snapshot "
                                      "(`/update_weights_from_disk`); `distributed` has the trainer broadcast it "
                                      "in buckets over a torch.distributed group (`/update_weights_from_distributed`, "
                                      "gloo on CPU, NCCL on GPU). Instances switching later to an older live "
                                      "version always load its snapshot.", choices=("disk", "distributed"))
    bucket_mb: float = field_doc(256.0, "Largest bucket of the `distributed` weight transport (a bigger tensor is "
                                 "sent alone).", gt=0.0, unit="MB")
