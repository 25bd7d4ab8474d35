"""The package around the ops: loading, build info, the torch version check, linking, wrappers,
the op table's coverage, and the Python package's own shape (cheap import, no import cycle)."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import customops
from customops import testing


def _library_ops() -> set[str]:
    """The public overloads of the library ("mul", "muladd.out", ...), read from the dispatcher."""
    return {n.removeprefix("customops::") for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("customops::") and not n.startswith("customops::_")}


def test_library_path_is_the_loaded_library():
    path = customops.library_path()
    assert os.path.isabs(path) and os.path.exists(path)
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert os.path.realpath(path) in maps or path in maps


def test_library_does_not_link_libpython():
    out = subprocess.run(["readelf", "-d", customops.library_path()], capture_output=True, text=True, check=True).stdout
    needed = [line for line in out.splitlines() if "NEEDED" in line]
    assert any("libtorch" in line for line in needed), out
    assert not any("libpython" in line or "torch_python" in line for line in needed), needed


def test_loading_again_is_harmless():
    torch.ops.load_library(customops.library_path())  # same file: dlopen returns the loaded copy
    a = torch.ones(3)
    torch.testing.assert_close(torch.ops.customops.muladd(a, a, 1.0), torch.full((3,), 2.0))


def test_build_info():
    info = customops.build_info()
    assert info["version"] == customops.__version__
    assert info["torch_version"] == torch.__version__
    assert info["compiler"]
    assert info["cuda"] == bool(info["cuda_archs"])


def test_cpu_kernels_use_torchs_openmp_runtime():
    # at::parallel_for is inline: without -fopenmp the CPU kernels would silently run on one
    # thread. They must share torch's OpenMP runtime: one libgomp in the process.
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not parallelize with OpenMP")
    assert customops.build_info()["cpu_threads"].startswith("OpenMP")
    # In a fresh process with torch and customops only: this one may hold other libraries' own
    # copies (the sentencepiece wheel that test_generate imports brings its libgomp).
    code = ("import re, customops\n"
            "runtime = re.compile(r'/lib(g|i|i5)?omp[^/]*\\.so')  # libgomp, libomp, libiomp5\n"
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if runtime.search(l)}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    runtimes = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def test_cmake_prefix_path_has_the_package_config():
    assert os.path.exists(os.path.join(customops.cmake_prefix_path, "customops", "customopsConfig.cmake"))


def test_wrappers_are_documented_and_exported():
    names = {op.partition(".")[0] for op in _library_ops()}
    assert "muladd" in names
    for name in sorted(names):
        fn = getattr(customops, name)
        assert name in customops.__all__
        assert fn.__doc__ and "Returns" in fn.__doc__, name


def test_op_table_has_a_row_per_op():
    # every overload of the library gets every check (the tests and the matrix loop over the table)
    assert {info.name for info in testing.OPS} == _library_ops()


def test_wrappers_match_torch_ops():
    x = torch.randn(4, 8)
    w = torch.rand(8)
    torch.testing.assert_close(customops.rms_norm(x, w, 1e-5), torch.ops.customops.rms_norm(x, w, 1e-5)[0])
    out = torch.empty(4, 8)
    assert customops.muladd(x, x, 1.0, out=out) is out
    torch.testing.assert_close(out, x * x + 1.0)


def test_torch_version_mismatch_is_a_clear_import_error():
    # Simulate a different running torch: the check must refuse before libcustomops.so loads.
    code = textwrap.dedent("""
        import torch
        torch.__version__ = "0.0.1+other"
        try:
            import customops
        except ImportError as e:
            print("IMPORTERROR:", e)
        else:
            print("imported")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR:" in out.stdout, out.stdout + out.stderr
    msg = out.stdout
    assert "0.0.1+other" in msg and customops.build_info()["torch_version"] in msg
    assert "pip install --no-build-isolation" in msg


def test_import_leaves_the_commands_and_the_op_table_alone():
    # import customops stays cheap: the CLI, benchmarks, support matrix and op table load on use
    code = "import sys, customops; print(' '.join(sorted(m for m in sys.modules if m.startswith('customops'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    loaded = set(out.stdout.split())
    assert "customops._ops" in loaded
    assert not loaded & {"customops.__main__", "customops._cli", "customops.bench", "customops.matrix",
                         "customops.testing", "customops.compile"}, loaded


def _runtime_nodes(node):
    """node and what it holds, but not the body of an `if TYPE_CHECKING:` (never run)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for grandchild in child.orelse:
                yield from _runtime_nodes(grandchild)
        else:
            yield from _runtime_nodes(child)


def _import_graph() -> dict[str, set[str]]:
    """Each Python module of the customops package -> the package's modules it imports anywhere
    (lazy imports in functions included) or names as a dotted string (tables of modules to import)."""
    files, modules = {}, set()
    for location in map(pathlib.Path, customops.__path__):  # the source tree and, if editable, the install
        for path in location.rglob("*"):
            if path.suffix in (".py", ".so"):
                parts = (location.name, *path.relative_to(location).parts)
                parts = (*parts[:-1], parts[-1].split(".")[0])
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules.add(name)
                if path.suffix == ".py":
                    files.setdefault(name, path)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                # `from P import m` of a submodule m imports m (P, its parent, is loaded before m)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
                targets.add(node.value)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_no_import_cycle_in_customops():
    graph = _import_graph()
    assert graph["customops.__main__"] >= {"customops.matrix", "customops.bench"}  # the command table is seen
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
