"""dora_megatron: asynchronous RL for LLMs with multi-version streaming rollout (DORA).

Importing the package is cheap on purpose: torch, megatron, sglang and
transformer_engine are imported only inside the adapters that need them.
"""

__version__ = "0.1.0"
