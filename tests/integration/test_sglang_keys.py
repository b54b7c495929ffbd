"""An SGLang 0.5.23 server started as a job starts it: its keys from ``--config`` (a 0600 YAML, never
on the command line), enforced with 0.5.23's own levels; dora's SGLang client sends the job's secret.
(The stand-in serves here; the real server reads the same ``--config``, ``server_args.py``: the
SGLang tier checks the same refusals on the real servers of a running job,
``tests/integration/test_sglang_real_faults.py``, whose whole run is the client sending the keys.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dora_megatron.comm import auth
from tests.helpers.sglang_keys import refusals, status
from tests.sglang_standin import start_standin

pytestmark = pytest.mark.integration


def test_a_job_started_sglang_asks_for_the_keys_and_the_client_sends_them(model_dir, tmp_path, monkeypatch):
    from dora_megatron.comm.sglang_client import SGLangClient

    secret = auth.new_secret()
    keys = tmp_path / auth.SGLANG_KEYS_FILE
    auth.write_sglang_keys(keys, secret)
    inst = start_standin(model_dir, tmp_path, name="sgl-keys", extra_args=tuple(auth.sglang_config_args(
        {auth.SGLANG_KEYS_ENV: str(keys)})))
    try:
        cmdline = Path(f"/proc/{inst.proc.pid}/cmdline").read_bytes().decode()
        assert str(keys) in cmdline and secret not in cmdline
        assert set(refusals(inst.url, model_dir).values()) == {(401, 401)}
        assert status(inst.url + "/health", None, None) == 200

        monkeypatch.setenv(auth.SECRET_ENV, secret)  # what a job's controller process holds

        async def as_the_job():
            client = SGLangClient(inst.url)
            try:
                out = await client.generate([1, 5, 6], {"max_new_tokens": 2, "temperature": 0})
                await client.pause("abort")
                await client.continue_generation()
                return out, await client.weight_version()
            finally:
                await client.close()

        out, version = asyncio.run(as_the_job())
        assert len(out.output_ids) == 2 and version == "0"
    finally:
        inst.stop()
    # (real 0.5.23 logs its keys; a job relays that log redacted: tests/helpers/sglang_real.py)
    assert secret not in inst.log()
