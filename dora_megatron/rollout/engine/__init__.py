"""Embedded rollout engine: Qwen3 / Qwen3-MoE in plain torch behind SGLang's HTTP protocol.

Submodules: ``model`` (forward pass over HF-named weights), ``kv_cache`` (per-request KV in
blocks), ``sampler`` (per-request seeded sampling and logprobs), ``scheduler`` (continuous
batching, single-threaded core), ``runner`` (the engine thread), ``server`` (aiohttp app),
``process`` (start an engine as a child process on a free port). The torch.distributed
weight-update group the server joins is :mod:`dora_megatron.comm.weight_group` (the trainer side
builds the same group). Nothing heavy is imported here.
"""
