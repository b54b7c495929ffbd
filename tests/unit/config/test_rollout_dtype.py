"""rollout.dtype: passed to every embedded engine; refused where it cannot act or would break checks."""

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.launch.plan import local_plan


def _engine_argv(cfg):
    return [p.argv for p in local_plan(cfg, "/m", "/r") if p.role == "engine"]


def test_embedded_engines_get_the_dtype():
    cfg = load_config(None, ["rollout.dtype=bfloat16", "controller.verify_checksums=false"])
    argvs = _engine_argv(cfg)
    assert argvs and all(a[a.index("--dtype") + 1] == "bfloat16" for a in argvs)
    assert all(a[a.index("--dtype") + 1] == "float32" for a in _engine_argv(load_config(None, [])))


def test_cast_engines_refuse_checksum_verification_and_sglang():
    with pytest.raises(ConfigError, match="controller.verify_checksums"):
        load_config(None, ["rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, ["rollout.dtype=bfloat16", "controller.verify_checksums=false", "rollout.engine=sglang",
                           "rollout.device=cuda"])
