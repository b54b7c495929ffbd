"""Tests share code only through ``tests/helpers``: a test module that imports another test module
runs that module's tests' import side effects, ties two files that move separately, and hides shared
code where no one looks for it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def cross_test_imports(root: Path) -> list[str]:
    """``file: module`` for every import of a ``test_*`` module under ``root`` (outside helpers too)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     # ``from tests.integration import test_x`` names the test module as an alias
                     else [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names
                      if n.startswith("tests.") and any(part.startswith("test_") for part in n.split("."))]
    return found


def test_no_test_module_imports_another():
    assert cross_test_imports(TESTS) == []


def test_the_check_sees_a_cross_import(tmp_path):
    (tmp_path / "test_a.py").write_text("from tests.unit.test_b import helper\n")
    (tmp_path / "test_c.py").write_text("def f():\n    import tests.integration.test_d\n")
    (tmp_path / "test_e.py").write_text("from tests.integration import test_f as f\n")
    (tmp_path / "ok.py").write_text("from tests.helpers.fakes import FakeTrainer\nfrom tests import helpers\n")
    assert cross_test_imports(tmp_path) == ["test_a.py: tests.unit.test_b", "test_a.py: tests.unit.test_b.helper",
                                            "test_c.py: tests.integration.test_d",
                                            "test_e.py: tests.integration.test_f"]
