"""``python -m dora_megatron`` is the ``dora`` console script."""

from dora_megatron.cli.main import entrypoint

entrypoint()
