"""Embedded rollout engine: Qwen3 / Qwen3-MoE in plain torch behind SGLang's HTTP protocol.

Submodules: ``model`` (forward pass over HF-named weights), ``kv_cache`` (per-request KV in
blocks), ``sampler`` (per-request seeded sampling and logprobs), ``scheduler`` (continuous
batching, single-threaded core), ``runner`` (the engine thread), ``server`` (aiohttp app),
``weight_sync`` (the torch.distributed weight-update group), ``process`` (start an engine as a
child process on a free port). Nothing heavy is imported here.
"""
