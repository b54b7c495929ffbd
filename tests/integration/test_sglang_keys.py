"""An SGLang 0.5.23 server started as a job starts it: its keys from ``--config`` (a 0600 YAML, never
on the command line), enforced with 0.5.23's own levels; dora's SGLang client sends the job's secret.
(The stand-in serves here; the real server reads the same ``--config``, ``server_args.py``.)"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dora_megatron.comm import auth
from tests.sglang_standin import start_standin

pytestmark = pytest.mark.integration


def status(url: str, body: dict | None, secret: str | None) -> int:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers=auth.auth_headers(secret))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _start_real(model_dir, log_dir, *, name, extra_args):
    from tests.helpers.sglang_real import start_real_sglang

    return start_real_sglang(model_dir, log_dir, name=name, extra_args=extra_args)


@pytest.mark.parametrize("server", ["standin", pytest.param("real", marks=pytest.mark.sglang)])
def test_a_job_started_sglang_asks_for_the_keys_and_the_client_sends_them(server, model_dir, tmp_path, monkeypatch):
    """The stand-in, and the real SGLang 0.5.23 server of the SGLang tier (``DORA_SGLANG=1``)."""
    from dora_megatron.comm.sglang_client import SGLangClient

    secret = auth.new_secret()
    keys = tmp_path / auth.SGLANG_KEYS_FILE
    auth.write_sglang_keys(keys, secret)
    start = start_standin if server == "standin" else _start_real
    inst = start(model_dir, tmp_path, name=f"sgl-keys-{server}", extra_args=tuple(auth.sglang_config_args(
        {auth.SGLANG_KEYS_ENV: str(keys)})))
    try:
        cmdline = Path(f"/proc/{inst.proc.pid}/cmdline").read_bytes().decode()
        assert str(keys) in cmdline and secret not in cmdline
        gen = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        for path, body in (("/generate", gen), ("/get_server_info", None), ("/pause_generation", {}),
                           ("/update_weights_from_disk", {"model_path": str(model_dir)})):
            assert status(inst.url + path, body, None) == 401, path
            assert status(inst.url + path, body, auth.new_secret()) == 401, path  # 0.5.23: 401 for a wrong key too
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
    if server == "standin":  # real 0.5.23 logs its keys; a job relays that log redacted (test_sglang_real.py)
        assert secret not in inst.log()
