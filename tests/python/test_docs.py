"""The documentation cannot drift from the code: every code block of the README and the guides
runs (docs/contributing.md says how a block's fence marks how it runs), the op tables list every
registered op, the runner's --help lists its commands, and the package keeps its shape (no module
over 600 lines, no import cycle)."""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import customops

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


def _blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, tag, code) of every fenced block of a markdown file."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            start, lang, tag = i + 1, m.group(1), m.group(2).strip()
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((start, lang, tag, "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return out


def _runs_here(lang: str, tag: str) -> bool | None:
    """Whether a block runs on this machine: None where it never runs (not a runnable language, or
    a long run), False where it needs what this machine lacks."""
    if lang not in ("python", "bash") or tag in ("long", "ci"):
        return None
    if tag == "cuda":
        return torch.cuda.is_available() and customops.build_info()["cuda"]
    if tag == "multi-gpu":
        return torch.cuda.device_count() >= 2 and customops.build_info()["cuda"]
    assert tag == "", f"unknown block tag {tag!r} (docs/contributing.md lists them)"
    return True


# Runs a document's blocks in order in one process: Python blocks in one namespace, shell blocks
# in the same folder.
DRIVER = textwrap.dedent('''
    import json, subprocess, sys, traceback, types
    blocks = json.load(open(sys.argv[1]))
    # the blocks' module, importable by name (torch.compile imports the module of the code it traces)
    module = sys.modules["__docs__"] = types.ModuleType("__docs__")
    ns = module.__dict__
    for where, lang, code in blocks:
        print(f"=== {where} ({lang})", flush=True)
        if lang == "python":
            try:
                exec(compile(code, where, "exec"), ns)
            except BaseException:
                traceback.print_exc()
                sys.exit(f"the block at {where} failed")
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", code])
            if r.returncode:
                sys.exit(f"the block at {where} exited {r.returncode}")
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("doc", [pytest.param(d, id=d.name) for d in DOCS if any(
    _runs_here(lang, tag) is not None for _, lang, tag, _ in _blocks(d))])
def test_every_code_block_runs(doc, tmp_path):
    import json

    blocks = [(f"{doc.relative_to(ROOT)}:{line}", lang, code) for line, lang, tag, code in _blocks(doc)
              if _runs_here(lang, tag)]
    if not blocks:
        pytest.skip("its blocks need a GPU (bash .ci/gpu docs runs them)")
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "driver.py").write_text(DRIVER)
    runner_dir = os.path.dirname(customops.runner_path())
    env = {**os.environ, "PATH": f"{runner_dir}:{os.environ['PATH']}", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


def test_blocks_that_do_not_run_are_checked_as_far_as_they_can_be():
    """"bash ci" is the README's two commands, which .ci/run must run as written; "bash long" (a
    long measurement or fuzz run) must parse, and the test files it names must exist."""
    ci = (ROOT / ".ci" / "run").read_text()
    for doc in DOCS:
        for line, lang, tag, code in _blocks(doc):
            where = f"{doc.name}:{line}"
            if tag == "ci":
                for command in (c for c in code.splitlines() if c.strip() and not c.startswith("#")):
                    for part in (p.strip() for p in command.split("&&")):  # (.ci/run: pip quietly, a line each)
                        assert part in ci or part.replace("pip install", "python -m pip install -q") in ci, \
                            f"{where}: .ci/run does not run {part!r}"
            elif tag == "long":
                assert subprocess.run(["bash", "-n", "-c", code]).returncode == 0, f"{where}: not valid bash"
                for name in re.findall(r"tests/python/\S+\.py", code):
                    assert (ROOT / name).is_file(), f"{where}: {name} does not exist"


def _registered_ops() -> set[str]:
    """customops' public ops as the dispatcher has them ("muladd", "muladd.out", ...)."""
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        ns, _, name = schema.name.partition("::")
        if ns == "customops" and not name.startswith("_"):
            names.add(name + (f".{schema.overload_name}" if schema.overload_name else ""))
    return names


def _table_ops(path: Path) -> set[str]:
    """The ops the first column of a markdown op table names (code spans, up to their "(")."""
    text = path.read_text()
    header = text.index("| op (`torch.ops.customops.*`)")
    rows = text[header:].split("\n\n", 1)[0].splitlines()[2:]
    ops = set()
    for row in rows:
        for span in re.findall(r"`([^`]+)`", row.split("|")[1]):
            ops.add(span.split("(")[0])
    return ops


@pytest.mark.parametrize("doc", ["README.md", "docs/ops.md"])
def test_op_tables_list_every_registered_op(doc):
    listed, registered = _table_ops(ROOT / doc), _registered_ops()
    assert registered - listed == set(), f"{doc} does not list {sorted(registered - listed)}"
    assert listed - registered == set(), f"{doc} lists ops that are not registered: {sorted(listed - registered)}"


def test_the_runner_s_help_lists_the_commands_it_has():
    """The commands main() dispatches on, those --help lists, and those the deployment and serving
    guides show are the same; each answers --help."""
    main = (ROOT / "cpp" / "runner" / "main.cpp").read_text()
    dispatched = set(re.findall(r'std::string\(argv\[1\]\) == "(\w+)"', main))
    usage = subprocess.run([customops.runner_path(), "--help"], capture_output=True, text=True).stdout
    listed = set(re.findall(r"^\s*(?:usage:)?\s*customops-run ([a-z]+) ", usage, re.M))
    assert dispatched and listed == dispatched, (listed, dispatched)
    guide = (ROOT / "docs" / "deployment.md").read_text() + (ROOT / "docs" / "serving.md").read_text()
    for command in dispatched:
        r = subprocess.run([customops.runner_path(), command, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"customops-run {command}" in r.stdout, r.stderr
        assert f"customops-run {command} " in guide, f"the guides never show customops-run {command}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into a guide"
    for guide in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (ROOT / guide).is_file(), guide


def _anchors(text):
    """GitHub's anchors of a Markdown file's headings (lowercased, punctuation but '-' and '_'
    dropped, spaces to '-', repeats numbered)."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_into_the_docs_finds_its_file_and_heading():
    """A link such as [x](benchmarks.md#a-section) breaks silently when the section is renamed."""
    anchors = {doc.resolve(): _anchors(doc.read_text()) for doc in DOCS}
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)\s#]*\.md|)#([^)\s]+)\)", doc.read_text()):
            path = (doc.parent / target).resolve() if target else doc.resolve()
            if anchor not in anchors.get(path, set()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


PACKAGE = ROOT / "python" / "customops"


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by what they do: {long}"


def _module_imports(path: Path) -> set[str]:
    """The customops modules a module imports when it is imported (module level, TYPE_CHECKING
    blocks included: a cycle there is still a knot to read)."""
    name = ".".join(("customops",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    nodes += [n for top in tree.body if isinstance(top, ast.If) for n in top.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "customops"}
            continue
        base = node.module or ""
        if node.level:
            parent = package.split(".")
            parent = parent[:len(parent) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        if base.split(".")[0] != "customops":
            continue
        for alias in node.names:  # a submodule where one is named, else the module itself
            sub = f"{base}.{alias.name}"
            out.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file()
                    or (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").is_file() else base)
    return out - {name}


def test_the_package_has_no_import_cycle():
    graph = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(("customops",) + p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _module_imports(p)
    # a package imports its parent package first: an edge to an ancestor is no cycle of its own
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for d in graph.get(n, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
