"""The wire between the controller, the trainer and the rollout engines.

WHY a package of its own: the trainer pushes weights to engines, the engines receive them, and the
controller drives both; each side must agree on the same HTTP bodies (``protocol``), the same
clients of those endpoints (``engine_client``, ``sglang_client``), the same torch.distributed
weight-update group (``weight_group``), the same weights checksum (``checksum``) and the same
routed-experts encoding (``routed_experts``). Keeping these here lets ``trainer``, ``weights`` and
``rollout`` stay independent of each other (``.importlinter``): each imports this package, none
imports another. It imports nothing else of dora_megatron.
"""
