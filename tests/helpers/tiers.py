"""The opt-in tiers of real third-party servers (vLLM, SGLang), each run from a venv of its own."""

from __future__ import annotations

import os

import pytest


def require_venv(flag: str, python: str, name: str, setup: str, python_env: str) -> str:
    """``python`` (a tier venv's interpreter) when the tier is asked for (``flag=1``), else a skip.
    Asked for without the venv: a skip locally, a failure under ``CI=true`` (the tier cannot run)."""
    if os.environ.get(flag) != "1":
        pytest.skip(f"{name} tier is opt-in: {flag}=1 (after bash {setup})")
    if os.access(python, os.X_OK):
        return python
    why = f"no {name} venv at {python} (bash {setup}, or set {python_env})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{flag}=1 in CI but {why}")
    pytest.skip(why)
