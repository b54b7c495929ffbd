"""Typed configuration: nested dataclasses loaded strictly from YAML.

Import :func:`load_config` from :mod:`dora_megatron.config.schema`; this package
init stays empty of imports so that ``import dora_megatron`` is cheap.
"""
