"""The type checker (mypy, config in ``mypy.ini``) passes on the modules it covers, and catches errors.

WHY a test: CI runs the default suite, so a type error in the orchestrator, the events, the losses
or the typed part of the wire, or a controller ``Runtime`` that hands a component a collaborator
other than the one its constructor declares, or an engine's answer that is not the
``EngineAnswer`` the events declare, fails CI like any other test. Missing mypy skips locally but fails
under ``CI=true`` (``pip install -e '.[test]'`` installs the pinned version): a check that silently
does not run is worse than none.
"""

from __future__ import annotations

import importlib.util
import os
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

# the pool's recorder declared as another type than the one the Runtime hands it
PLANTED_COLLABORATOR = ("metrics: MetricsRecorder,", "metrics: int,")

# a workflow's reply whose versions are no longer what events.answer.EngineAnswer declares
PLANTED_ANSWER = ("    versions_used: list[str]\n    prompt_ids:", "    versions_used: int\n    prompt_ids:")


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
    pool = tmp_path / "dora_megatron" / "controller" / "pool.py"
    declared, planted = PLANTED_COLLABORATOR
    assert pool.read_text().count(declared) == 1, "Pool.__init__ declares no `metrics: MetricsRecorder,`"
    pool.write_text(pool.read_text().replace(declared, planted))
    runner = tmp_path / "dora_megatron" / "workflow" / "runner.py"
    declared, planted = PLANTED_ANSWER
    assert runner.read_text().count(declared) == 1, "WorkflowReply declares no `versions_used: list[str]`"
    runner.write_text(runner.read_text().replace(declared, planted))
    proc = _mypy(tmp_path, cache)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "rules.py" in out and "[return-value]" in out and "[no-untyped-def]" in out, out
    # the Runtime hands the pool its recorder: the collaborator is checked where it is handed
    handed = [line for line in out.splitlines() if "runtime.py" in line and ": error:" in line]
    assert handed and all("[arg-type]" in line and '"Pool"' in line and '"metrics"' in line for line in handed), out
    # the generation reports the workflow's reply as an engine's answer: the answer is checked there
    reported = [line for line in out.splitlines() if "generation.py" in line and ": error:" in line]
    assert reported and all("[arg-type]" in line and "WorkflowReply" in line and "EngineAnswer" in line
                            for line in reported), out
