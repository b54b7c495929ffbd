"""Probing a server's keyed endpoints as SGLang 0.5.23 guards them: the status of each without a key
and with a wrong one (shared by the stand-in keys test and the SGLang tier's fault job)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from dora_megatron.comm import auth


def status(url: str, body: dict | None, secret: str | None) -> int:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers=auth.auth_headers(secret))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def refusals(url: str, model_dir: str) -> dict[str, tuple[int, int]]:
    """Each keyed endpoint's status without a key and with a wrong one (0.5.23: 401 for both)."""
    gen = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    return {path: (status(url + path, body, None), status(url + path, body, auth.new_secret()))
            for path, body in (("/generate", gen), ("/get_server_info", None), ("/pause_generation", {}),
                               ("/update_weights_from_disk", {"model_path": str(model_dir)}))}
