"""A tokenizer with a Qwen3-style tool template (:mod:`tests.helpers.tool_model`), and a scripted engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dora_megatron.comm.engine_client import VersionMismatch


@pytest.fixture(scope="session")
def tool_codec(own_model, tmp_path_factory):
    from dora_megatron.data.codec import load_codec
    from tests.helpers.tool_model import tool_model_dir

    return load_codec(tool_model_dir(own_model.model_dir, tmp_path_factory.mktemp("tool_model") / "model"))


class ScriptedEngine:
    """Answers the i-th generate with ``turns[i]`` (token ids; the last turn repeats), each token's
    log-prob ``-(index + 1) / 100`` so tests can tell whose log-probs ended where. Holds weight
    ``version`` and refuses others (HTTP 409, as the real engines)."""

    def __init__(self, turns: list[list[int]], version: int = 3, finish: str = "stop") -> None:
        self.turns = turns
        self.version = version
        self.finish = finish
        self.calls: list[dict] = []

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None, **kw):
        if version is not None and int(version) != self.version:
            raise VersionMismatch("scripted", 409, f"weight version {self.version} != requested {version}")
        out = list(self.turns[min(len(self.calls), len(self.turns) - 1)])
        out = out[:sampling_params.get("max_new_tokens", len(out))] if sampling_params else out
        self.calls.append({"input_ids": list(input_ids), "sampling": dict(sampling_params or {}), "rid": rid,
                           "version": version})
        return SimpleNamespace(output_ids=out, output_token_logprobs=[-(i + 1) / 100 for i in range(len(out))],
                               finish_reason={"type": self.finish}, versions_used=[str(self.version)], raw={})
