"""No class in the package is one a reader must hold whole: each stays within 500 lines and 40
methods (issue A3 item 4: the orchestrator's tables, the simulator's clock/executor/checks and the
scheduler's speculation and export format were split out of classes of 1,073, 748 and 707 lines;
the trainer worker's step metrics and perf arithmetic out of a class of 536). A class that grows
past the bound fails here, naming it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dora_megatron"
#: every package of dora_megatron, and its top-level modules ("")
AREAS = ("", *sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()))
MAX_LINES, MAX_METHODS = 500, 40


def class_sizes(path: Path) -> list[tuple[str, int, int]]:
    """``(name, lines, methods)`` of every top-level class of the module at ``path``."""
    tree = ast.parse(path.read_text())
    return [(node.name, node.end_lineno - node.lineno + 1,
             sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body))
            for node in tree.body if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("area", AREAS)
def test_no_class_over_500_lines_or_40_methods(area):
    modules = sorted((PACKAGE / area).rglob("*.py") if area else PACKAGE.glob("*.py"))
    assert modules, area
    too_big = [f"{m.relative_to(PACKAGE)}::{name} ({lines} lines, {methods} methods)"
               for m in modules for name, lines, methods in class_sizes(m)
               if lines > MAX_LINES or methods > MAX_METHODS]
    assert not too_big, too_big


def test_the_measure_sees_a_large_class(tmp_path):
    """The bound can fail: a class of 41 methods is reported with its size."""
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(41))
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + body)
    assert class_sizes(big) == [("Big", 83, 41)]
