"""The type checker (mypy, config in ``mypy.ini``) passes on the modules it covers, and catches errors.

WHY a test: CI runs the default suite, so a type error in the orchestrator, the events, the losses
or the typed part of the wire, or a controller ``Runtime`` that no longer satisfies a component's
``*Host`` protocol, fails CI like any other test. Missing mypy skips locally but fails
under ``CI=true`` (``pip install -e '.[test]'`` installs the pinned version): a check that silently
does not run is worse than none.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# a wrong return type and an unannotated function: the second is an error only under --strict
PLANTED = '''

def _planted_wrong_return(x: int) -> str:
    return x


def _planted_untyped(x):
    return x
'''

# a member the Runtime does not have, added to the protocol of what the summary reads of it
PLANTED_HOST_MEMBER = "    planted_member: int\n"


def _require_mypy() -> None:
    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mypy is not installed (pip install -e '.[test]'); CI must run the type check")
        pytest.skip("mypy not installed (pip install -e '.[test]')")


def _mypy(root: Path, cache: Path) -> subprocess.CompletedProcess:
    """mypy over the files ``mypy.ini`` lists, in the tree at ``root``."""
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary"], cwd=root,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One mypy cache for both runs: the second reads torch's and the stdlib's types from it."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_checked_modules_are_clean(cache):
    _require_mypy()
    proc = _mypy(REPO, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_catches_a_planted_error(tmp_path, cache):
    _require_mypy()
    shutil.copytree(REPO / "dora_megatron", tmp_path / "dora_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "mypy.ini", tmp_path / "mypy.ini")
    target = tmp_path / "dora_megatron" / "orchestrator" / "rules.py"
    target.write_text(target.read_text() + PLANTED)
    summary = tmp_path / "dora_megatron" / "controller" / "summary.py"
    text, n = re.subn(r'(class SummaryHost\(Protocol\):\n    """.*?"""\n)', lambda m: m.group(1) + PLANTED_HOST_MEMBER,
                      summary.read_text(), count=1, flags=re.DOTALL)
    assert n == 1, "no SummaryHost protocol with a docstring in controller/summary.py"
    summary.write_text(text)
    proc = _mypy(tmp_path, cache)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "rules.py" in out and "[return-value]" in out and "[no-untyped-def]" in out, out
    # the Runtime handed to run_summary lacks the planted member: the protocol is checked where it is used
    host_errors = [line for line in out.splitlines() if "runtime.py" in line and ": error:" in line]
    assert host_errors and all("[arg-type]" in line and '"SummaryHost"' in line for line in host_errors), out
    assert "planted_member" in out, out
