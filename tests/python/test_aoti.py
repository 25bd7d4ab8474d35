"""Python-less inference: a module calling every op of the op table is exported with a dynamic
batch, packaged with AOTInductor (once per device, customops.export.package) and run by
customops-run in a clean environment, by a find_package(customops) consumer, and (the item 5
reproducer) by aoti_load_package in the process that compiled it."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import customops
import aoti_models as M
from conftest import DEVICES

HERE = Path(__file__).resolve().parent
PYTHON_LIBS = ("libpython", "libtorch_python")


def clean_env() -> dict:
    """PATH only (plus the GPU selection and the library path, which are not Python's): no
    PYTHONPATH, PYTHONHOME, venv."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    for name in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run(cmd, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**clean_env(), **(env or {})},
                          timeout=300, **kw)


def describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


# ---- one package per device, shared by the module ----------------------------------------------

class Package:
    def __init__(self, device: str, root: Path):
        torch.manual_seed(0)
        self.device, self.root = device, root
        self.case = M.every_op(device)
        self.path = Path(customops.export.package(self.case.module, self.case.inputs(3), root / "every_op.pt2",
                                                  dynamic_shapes=self.case.dynamic_shapes))

    def write_inputs(self, n: int, name: str | None = None) -> tuple[Path, tuple]:
        inputs = self.case.inputs(n)
        path = self.root / (name or f"inputs-{n}.pt")
        customops.export.save_inputs(inputs, path)
        return path, inputs


_packages: dict[str, Package] = {}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    def get(device: str) -> Package:
        if device not in _packages:
            _packages[device] = Package(device, tmp_path_factory.mktemp(f"aoti-{device}"))
        return _packages[device]

    yield get
    _packages.clear()


@pytest.fixture(scope="module", params=DEVICES)
def package(request, packages) -> Package:
    return packages(request.param)


# ---- customops-run ----------------------------------------------------------------------------

def test_runner_is_installed_and_links_no_python():
    runner = customops.runner_path()
    assert "runner_path" in customops.__all__
    ldd = subprocess.run(["ldd", runner], capture_output=True, text=True, check=True).stdout
    assert "libcustomops" in ldd, ldd
    assert "not found" not in ldd, ldd
    for lib in PYTHON_LIBS:
        assert lib not in ldd, f"customops-run links {lib}:\n{ldd}"
    version = run([runner, "--version"])
    assert version.returncode == 0 and customops.__version__ in version.stdout, version


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's dynamic linker")
def test_runner_binds_std_filesystem_to_libstdcxx(tmp_path):
    """torch's libraries export a copy of std::filesystem, and torch 2.11's CUDA libtorch.so has one
    whose remove_all calls through a null pointer (customops-run crashed so at exit): customops-run
    lists libstdc++ before torch, so that every std::filesystem symbol libstdc++ defines binds to it
    from customops' own objects (LD_BIND_NOW: every reference bound as the program loads, LD_DEBUG:
    each binding written). Torch's libraries may bind to their own copies (torch 2.11's
    libtorch_cuda.so does): they are built and tested with them."""
    r = run([customops.runner_path(), "--version"],
            env={"LD_BIND_NOW": "1", "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "bind")})
    assert r.returncode == 0, r.stderr
    ours = {}  # symbol -> the objects it bound to from customops-run and libcustomops*.so
    pattern = r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `(\w*St10filesystem\w*)'"
    for f in tmp_path.glob("bind*"):
        for m in re.finditer(pattern, f.read_text()):
            if Path(m.group(1)).name == "customops-run" or Path(m.group(1)).name.startswith("libcustomops"):
                ours.setdefault(m.group(3), set()).add(m.group(2))
    stdcxx = {t for ts in ours.values() for t in ts if Path(t).name.startswith("libstdc++")}
    assert len(stdcxx) == 1, ours
    lib = ctypes.CDLL(next(iter(stdcxx)))
    wrong = {s: sorted(ts) for s, ts in ours.items() if hasattr(lib, s) and ts != stdcxx}
    assert not wrong, wrong


NULL_CALL = r"""
#include <stdlib.h>
void (*volatile null_target)(void);
__attribute__((noinline)) void calls_through_null(void) { null_target(); __asm__ volatile(""); }
static void at_exit(void) { calls_through_null(); }
__attribute__((constructor)) static void init(void) { atexit(at_exit); }
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64" or not shutil.which("cc"),
                    reason="the stack scan is x86-64's; needs a C compiler")
def test_a_crash_through_a_null_pointer_names_its_caller(tmp_path):
    """A call through a null pointer leaves a program counter of 0, where the unwinder stops at the
    signal's trampoline: the crash report then gives the return address the call left, which names
    the caller (how the crash of torch's exported std::filesystem::remove_all was found), and the
    return addresses further up the stack. Here a library preloaded into customops-run makes that
    call as the process exits."""
    (tmp_path / "null_call.c").write_text(NULL_CALL)
    lib = tmp_path / "libnull_call.so"
    subprocess.run(["cc", "-O1", "-fPIC", "-shared", "-o", lib, tmp_path / "null_call.c"], check=True)
    r = run([customops.runner_path(), "--version"], env={"LD_PRELOAD": str(lib)})
    assert r.returncode == -signal.SIGSEGV, describe(r.returncode) + r.stderr
    lines = r.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "the program counter was 0x0, in no loaded object" in line)
    assert re.match(r"^\S*libnull_call\.so\(calls_through_null\+0x[0-9a-f]+\)", lines[at + 1]), r.stderr
    assert "return addresses further up the stack" in lines[at + 2], r.stderr


def test_runner_matches_eager_at_three_batch_sizes(package):
    runner = customops.runner_path()
    for n in M.BATCH_SIZES:
        inputs_file, inputs = package.write_inputs(n)
        outputs_file = package.root / f"outputs-{n}.pt"
        r = run([runner, "--time", "--runs", "3", "--show-libraries", package.path, inputs_file, outputs_file])
        assert r.returncode == 0, f"customops-run {describe(r.returncode)} at batch {n}:\n{r.stderr}"
        got = torch.load(outputs_file, weights_only=True)
        want = M.eager(package.case, inputs)
        assert isinstance(got, tuple) and len(got) == len(want), (type(got), len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.device.type == "cpu"
            torch.testing.assert_close(g, w.cpu(), msg=lambda m: f"batch {n}, output {i}: {m}")

        assert re.search(r"^load: [\d.]+ ms$", r.stdout, re.M), r.stdout
        assert re.search(rf"^run: [\d.]+ ms mean, [\d.]+ ms best, 3 run\(s\) on {package.device}", r.stdout, re.M), r.stdout
        libs = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("library: ")]
        assert any("libcustomops.so" in lib for lib in libs), libs
        assert any("/data/aotinductor/" in lib for lib in libs), f"the model's .so was not loaded: {libs}"
        for lib in PYTHON_LIBS:
            assert not any(lib in x for x in libs), f"customops-run loaded {lib}: {libs}"


def test_runner_takes_the_device_from_the_package(package):
    inputs_file, inputs = package.write_inputs(4)
    out = package.root / "outputs-device.pt"
    r = run([customops.runner_path(), "--device", package.device, package.path, inputs_file, out])
    assert r.returncode == 0, r.stderr
    other = "cpu" if package.device == "cuda" else "cuda"
    r = run([customops.runner_path(), "--device", other, package.path, inputs_file, out])
    assert r.returncode == 1
    assert f"was compiled for {package.device} and cannot run on {other}" in r.stderr, r.stderr


def test_runner_metadata_records_versions(package):
    r = run([customops.runner_path(), "--info", package.path])
    assert r.returncode == 0, r.stderr
    assert f"AOTI_DEVICE_KEY: {package.device}" in r.stdout
    assert f"customops_version: {customops.__version__}" in r.stdout
    assert f"customops_torch_version: {torch.__version__}" in r.stdout


def _static_dim(pkg: Package) -> tuple[int, int]:
    """(input, dim) of the first dimension that is not the batch."""
    spec = pkg.case.dynamic_shapes["flat"]
    for i, x in enumerate(pkg.case.inputs(2)):
        for d in range(x.dim()):
            if d not in (spec[i] or {}):
                return i, d
    raise AssertionError("every input dimension is dynamic")


def _assert_one_line_error(r: subprocess.CompletedProcess, rc: int, message: str):
    """Exit status rc and one "customops-run: <message>" line, the last on stderr (the model's
    own words, where it prints them, come before it)."""
    assert r.returncode == rc, f"{describe(r.returncode)}\n{r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("customops-run: "), r.stderr
    assert sum(line.startswith("customops-run") for line in lines) == 1, r.stderr
    assert re.search(r"^customops-run: " + message, lines[-1]), f"{message}\n{r.stderr}"
    assert lines[-1].isprintable(), repr(lines[-1])


def _rewrite_zip(src: Path, dst: Path, change) -> None:
    """Copies a zip archive, each member's bytes through change(name, data) (None drops it)."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = change(item.filename, zin.read(item))
            if data is not None:
                zout.writestr(item.filename, data)


def _bad_inputs(pkg: Package, case: str, path: Path) -> tuple[str, str | None]:
    """Writes an inputs file that is wrong in one way. Returns the regex of the runner's
    "customops-run: ..." line and, for errors the model itself reports, of the model's words
    (which older torch prints on stderr before the runner's line instead of passing them on)."""
    good = [t.cpu() for t in pkg.case.inputs(4)]
    n = len(good)
    pt2 = re.escape(str(pkg.path))
    bad = re.escape(str(path))
    expected = r" \(expected a tensor, or a list or tuple of tensors, written by torch\.save\)"
    if case == "missing":
        return rf"inputs file not found: {bad}$", None
    if case == "directory":
        path.mkdir()
        return rf"inputs file is not a regular file: {bad}$", None
    if case == "empty":
        path.write_bytes(b"")
        return rf"the inputs file {bad} is empty{expected}$", None
    if case == "random_bytes":
        path.write_bytes(os.urandom(4096))
        return rf"cannot read the inputs file {bad}: it is not a zip archive, as torch\.save writes{expected}$", None
    if case == "truncated":
        torch.save(good, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        # miniz's advice about checkpoints is cut off after the first sentence.
        return (rf"cannot read the inputs file {bad}{expected}: it is truncated or corrupt: "
                r"PytorchStreamReader failed reading zip archive: failed finding central directory\.$"), None
    if case == "short_record":
        # A consistent zip whose first tensor's data record lost its second half: pickle_load read
        # past its end and the model ran on whatever memory followed.
        torch.save(good, path.with_suffix(".tmp"))
        _rewrite_zip(path.with_suffix(".tmp"), path,
                     lambda name, data: data[: len(data) // 2] if name.endswith("/data/0") else data)
        return (rf"cannot read the inputs file {bad}{expected}: it is truncated or corrupt: .*require a storage of "
                rf"at least {good[0].nbytes} bytes, but storage only has {good[0].nbytes // 2} bytes$"), None
    if case == "garbled_pickle":
        # A class name with a non-UTF-8 byte and a terminal escape: the error quotes it.
        torch.save(good, path.with_suffix(".tmp"))
        _rewrite_zip(path.with_suffix(".tmp"), path,
                     lambda name, data: data.replace(b"torch._utils\n", b"torch.\xff\x1b[31m\n", 1)
                     if name.endswith("data.pkl") else data)
        return rf"cannot read the inputs file {bad}{expected}: it is truncated or corrupt: .*torch\.\?\?\[31m", None
    if case == "batch_mismatch":
        good[0] = torch.cat([good[0], good[0][:1]])  # batch 5, the other inputs 4
        torch.save(good, path)
        return (rf"running {pt2} failed: (an input of {bad} has size 4 in dim 0 where the model expects 5 \(inputs "
                rf"that share a dynamic dimension, such as the batch, must agree on its size\)$|.*printed above)",
                # The package's own guard (torch 2.13), or the first op that takes two of the
                # inputs (torch 2.11 packages check no sizes across inputs).
                r"expected size 4==5, stride \d+==\d+ at dim=0|customops::\w+: expected \w+ to have the shape of")
    if case == "too_few":
        torch.save(good[:-1], path)
        return rf"{pt2} takes {n} input tensor\(s\)( by its call spec)?, but .* holds {n - 1}", None
    if case == "too_many":
        torch.save(good + good[:1], path)
        return rf"{pt2} takes {n} input tensor\(s\)( by its call spec)?, but .* holds {n + 1}", None
    if case == "shape":
        i, d = _static_dim(pkg)
        shape = list(good[i].shape)
        shape[d] += 1
        good[i] = torch.randn(shape, dtype=good[i].dtype)
        torch.save(good, path)
        return (rf"running {pt2} failed: ",
                rf"input_handles\[{i}\]: unmatched dim value at {d}, expected: {shape[d] - 1}, but got: {shape[d]}")
    if case == "dtype":
        good[-1] = good[-1].to(torch.float64 if good[-1].dtype != torch.float64 else torch.float32)
        torch.save(good, path)
        return rf"running {pt2} failed: ", rf"input_handles\[{n - 1}\]: unmatched dtype"
    if case == "not_a_tensor":
        torch.save(good[:-1] + [3], path)
        return rf"input {n - 1} in .* is not a tensor but Int", None
    if case == "not_a_list":
        torch.save({"x": good[0]}, path)
        return r"the inputs file .* holds a GenericDict; expected a tensor, or a list or tuple of tensors", None
    raise ValueError(case)


@pytest.mark.parametrize("case", ["too_few", "too_many", "shape", "dtype", "not_a_tensor", "not_a_list", "missing",
                                  "directory", "empty", "random_bytes", "truncated", "short_record", "garbled_pickle",
                                  "batch_mismatch"])
def test_runner_rejects_bad_inputs(packages, tmp_path, case):
    pkg = packages("cpu")
    line, model_says = _bad_inputs(pkg, case, tmp_path / "bad.pt")
    (tmp_path / "tmp").mkdir()
    r = run([customops.runner_path(), pkg.path, tmp_path / "bad.pt", tmp_path / "out.pt"],
            env={"TMPDIR": tmp_path / "tmp"})
    _assert_one_line_error(r, 1, line)
    if model_says:
        assert re.search(model_says, r.stderr), f"{model_says}\n{r.stderr}"
    assert not (tmp_path / "out.pt").exists()
    assert not list((tmp_path / "tmp").iterdir()), "the unpacked package was left behind"


@pytest.mark.parametrize("case, rc, message", [
    ("missing", 1, r"package not found: .*missing\.pt2"),
    ("not_zip", 1, r"cannot load .*not_zip\.pt2: not an AOTInductor package"),
    ("truncated", 1, r"cannot read .*truncated\.pt2 \(model 'model'\): not a valid AOTInductor package"),
    ("other_zip", 1, r"cannot read .*other_zip\.pt2 \(model 'model'\): not a valid AOTInductor package"),
    ("usage", 2, r"expected PACKAGE\.pt2 INPUTS\.pt OUTPUTS\.pt, got 2 arguments"),
    ("bad_device", 1, r"--device expects cpu, cuda or cuda:N, got 'gpu'"),
    ("directory", 1, r"package is not a regular file: .*directory\.pt2$"),
    ("empty", 1, r"cannot load .*empty\.pt2: not an AOTInductor package"),
    # One flipped byte in the model's library: miniz unpacks it without checking its CRC, and
    # running it crashed (SIGSEGV, SIGILL).
    ("damaged", 1, r"cannot load .*damaged\.pt2: the package is damaged: .*\.wrapper\.so does not match the checksum"),
    # Fails inside the loader, after it unpacked the package (the test checks the copy is removed).
    ("unknown_op", 1, r"cannot load .*unknown_op\.pt2: Could not find schema for customopz::\w+\. \(the library that "
                      r"registers that operator must be loaded in this process before the package\)$"),
    ("no_such_model", 1, r".*no_such_model\.pt2 holds no model named 'nope' \(it holds: model\); pick one with "
                         r"--model-name$"),
])
def test_runner_rejects_bad_packages(packages, tmp_path, case, rc, message):
    import zipfile

    pkg = packages("cpu")
    inputs_file, _ = pkg.write_inputs(2)
    path = tmp_path / f"{case}.pt2"
    if case == "not_zip":
        path.write_bytes(os.urandom(4096))
    elif case == "truncated":
        path.write_bytes(pkg.path.read_bytes()[: pkg.path.stat().st_size // 2])
    elif case == "other_zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x/a.txt", "a")
            z.writestr("x/b.txt", "b")
    elif case == "directory":
        path.mkdir()
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "damaged":
        data = bytearray(pkg.path.read_bytes())
        with zipfile.ZipFile(pkg.path) as z:
            lib = next(i for i in z.infolist() if i.filename.endswith(".wrapper.so"))
        data[lib.header_offset + 30 + len(lib.filename) + lib.file_size // 2] ^= 0xFF  # inside the stored data
        path.write_bytes(data)
    elif case == "unknown_op":
        _rewrite_zip(pkg.path, path, lambda name, data: data.replace(b'"customops::', b'"customopz::')
                     if name.endswith(".wrapper.json") else data)
    elif case == "no_such_model":
        shutil.copy(pkg.path, path)
    elif case in ("usage", "bad_device"):
        path = pkg.path
    args = {"usage": [path, inputs_file], "bad_device": ["--device", "gpu", path, inputs_file, tmp_path / "o.pt"],
            "no_such_model": ["--model-name", "nope", path, inputs_file, tmp_path / "o.pt"]}
    (tmp_path / "tmp").mkdir()
    r = run([customops.runner_path(), *args.get(case, [path, inputs_file, tmp_path / "o.pt"])],
            env={"TMPDIR": tmp_path / "tmp"})
    _assert_one_line_error(r, rc, message)
    assert not (tmp_path / "o.pt").exists()
    assert not list((tmp_path / "tmp").iterdir()), "the unpacked package was left behind"


@pytest.mark.parametrize("args, rc, message", [
    ("--runs 0 PKG IN OUT", 2, r"--runs expects an integer >= 1, got '0'$"),
    ("--runs -1 PKG IN OUT", 2, r"--runs expects an integer >= 1, got '-1'$"),
    ("--runs abc PKG IN OUT", 2, r"--runs expects an integer >= 1, got 'abc'$"),
    ("--runs 2.5 PKG IN OUT", 2, r"--runs expects an integer >= 1, got '2\.5'$"),
    ("--runs 99999999999999999999 PKG IN OUT", 2,
     r"--runs expects an integer >= 1 and <= 2147483647, got '99999999999999999999'$"),
    ("--warmup -1 PKG IN OUT", 2, r"--warmup expects an integer >= 0, got '-1'$"),
    ("--warmup -99999999999999999999 PKG IN OUT", 2, r"--warmup expects an integer >= 0 and <= 2147483647, got"),
    ("PKG IN OUT --runs", 2, r"--runs expects a value$"),
    ("--frobnicate PKG IN OUT", 2, r"unknown option --frobnicate \(see --help\)$"),
    ("--info", 2, r"--info expects one argument, PACKAGE\.pt2"),
    ("PKG IN EMPTY", 2, r"OUTPUTS\.pt is an empty string \(see --help\)$"),
    ("--device cpu:1 PKG IN OUT", 1, r"--device cpu:1: there is one cpu device; use --device cpu$"),
])
def test_runner_rejects_bad_arguments(packages, tmp_path, args, rc, message):
    pkg = packages("cpu")
    inputs_file, _ = pkg.write_inputs(2)
    names = {"PKG": pkg.path, "IN": inputs_file, "OUT": tmp_path / "o.pt", "EMPTY": ""}
    r = run([customops.runner_path(), *(names.get(a, a) for a in args.split())])
    _assert_one_line_error(r, rc, message)
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("case", ["missing_folder", "directory", "file_as_folder", "disk_full"])
def test_runner_rejects_bad_outputs(packages, tmp_path, case):
    if case == "disk_full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    pkg = packages("cpu")
    inputs_file, _ = pkg.write_inputs(2)
    wrong_shape = tmp_path / "wrong_shape.pt"
    _bad_inputs(pkg, "shape", wrong_shape)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    out, message = {
        "missing_folder": (tmp_path / "nowhere" / "o.pt",
                           r"cannot write the outputs file .*nowhere/o\.pt: the folder .*nowhere does not exist$"),
        "directory": (tmp_path / "dir", r"the outputs file .*dir is a directory; name a file in it$"),
        "file_as_folder": (tmp_path / "file" / "o.pt",
                           r"cannot write the outputs file .*file/o\.pt: .*file is not a folder$"),
        "disk_full": (Path("/dev/full"), r"cannot write the outputs file /dev/full: No space left on device$"),
    }[case]
    if case != "disk_full":
        # Checked before the inputs are read and the model runs: the error is the path's, although
        # these inputs would make the run fail.
        r = run([customops.runner_path(), pkg.path, wrong_shape, out])
        _assert_one_line_error(r, 1, message)
    r = run([customops.runner_path(), pkg.path, inputs_file, out])
    _assert_one_line_error(r, 1, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file", "wrong_shape.pt"]
    assert not list((tmp_path / "dir").iterdir()) and (tmp_path / "file").read_bytes() == b"x"


@pytest.mark.skipif("cuda" in DEVICES, reason="checks the error on a machine without CUDA")
def test_runner_explains_a_cuda_package_without_cuda(packages, tmp_path):
    # A CPU package whose metadata says cuda stands in for a CUDA package here.
    import zipfile

    pkg = packages("cpu")
    fake = tmp_path / "cuda.pt2"
    with zipfile.ZipFile(pkg.path) as src, zipfile.ZipFile(fake, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("wrapper_metadata.json"):
                data = data.replace(b'"AOTI_DEVICE_KEY": "cpu"', b'"AOTI_DEVICE_KEY": "cuda"')
            dst.writestr(item, data)
    inputs_file, _ = pkg.write_inputs(2)
    r = run([customops.runner_path(), fake, inputs_file, tmp_path / "o.pt"])
    assert r.returncode == 1
    assert "was compiled for cuda, but this process has no CUDA device" in r.stderr, r.stderr


# ---- a find_package(customops) consumer --------------------------------------------------------

def test_consumer_runs_the_package(package, consumer):
    inputs_file, inputs = package.write_inputs(5, "consumer-inputs.pt")
    expected = package.root / "consumer-expected.pt"
    torch.save([t.cpu() for t in M.eager(package.case, inputs)], expected)
    r = run([consumer / "run_package", package.path, inputs_file, expected])
    assert r.returncode == 0, f"run_package {describe(r.returncode)}:\n{r.stdout}\n{r.stderr}"
    assert "outputs match" in r.stdout


def test_package_fails_to_load_without_customops(packages, consumer):
    pkg = packages("cpu")
    inputs_file, inputs = pkg.write_inputs(2)
    r = run([consumer / "run_package_without_customops", pkg.path, inputs_file, inputs_file])
    assert r.returncode == 1, f"{describe(r.returncode)}\n{r.stdout}\n{r.stderr}"
    assert re.search(r"Could not find schema for customops::\w+", r.stderr), r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="ELF programs (readelf)")
def test_a_program_linking_customops_lists_libstdcxx_before_torch(consumer):
    """customops::customops's interface puts libstdc++ first among a program's libraries, ahead of
    torch's copy of std::filesystem (test_runner_binds_std_filesystem_to_libstdcxx says why), for
    every program of a user as for customops-run."""
    for program in (consumer / "engine_api", Path(customops.runner_path())):
        out = subprocess.run(["readelf", "-d", str(program)], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(\S+)\]", out)
        torch_first = min(i for i, lib in enumerate(needed) if lib.startswith(("libtorch", "libc10")))
        assert any(lib.startswith("libstdc++") for lib in needed[:torch_first]), (program.name, needed)


def test_tensor_files_round_trip_between_python_and_cpp(consumer, tmp_path):
    # torch.save -> torch::jit::pickle_load -> pickle_save -> torch.load(weights_only=True).
    tensors = [
        torch.randn(3, 4),
        torch.randn(5, 3).t(),  # transposed: strides survive
        torch.randn(4, 6)[:, ::2],  # strided view of a larger storage
        torch.arange(10, dtype=torch.int64),
        torch.randn(2, 3).to(torch.float16),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(2, 2, dtype=torch.float64),
        torch.tensor([True, False]),
        torch.tensor(2.5),  # 0-dim
        torch.empty(0, 3),
    ]
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(tensors, src)
    r = run([consumer / "run_package", "--copy", src, dst])
    assert r.returncode == 0, r.stderr
    back = torch.load(dst, weights_only=True)
    assert len(back) == len(tensors)
    for i, (a, b) in enumerate(zip(tensors, back)):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), i
        assert torch.equal(a, b), i


# ---- item 5: compile and load in one Python process ---------------------------------------------

def _same_process(device: str, model: str, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    # The environment is the test's own: this runs Python on purpose.
    return subprocess.run([sys.executable, "-X", "faulthandler", str(HERE / "aoti_same_process.py"), "--device",
                           device, "--model", model, *extra, str(out_dir)],
                          capture_output=True, text=True, timeout=900)


def _last_stage(r: subprocess.CompletedProcess) -> str:
    stages = [line for line in r.stdout.splitlines() if line.startswith("stage: ")]
    return stages[-1] if stages else "(no stage reached)"


SAME_PROCESS = [pytest.param(d, "every_op", id=f"{d}-every_op") for d in DEVICES]
if "cuda" in DEVICES:
    SAME_PROCESS.append(pytest.param("cuda", "aten_only", id="cuda-aten_only"))


@pytest.mark.parametrize("device, model", SAME_PROCESS)
def test_compile_then_load_in_one_python_process(device, model, tmp_path):
    r = _same_process(device, model, tmp_path)
    if r.returncode == 0:
        assert "stage: exiting" in r.stdout
        return
    # Tell apart: the package, Python loading it, and loading it in the process that compiled it.
    notes = []
    pt2 = tmp_path / f"{model}-{device}.pt2"
    if pt2.exists():
        fresh = _same_process(device, model, tmp_path, "--load-only")
        notes.append(f"the same package in a fresh Python process: {describe(fresh.returncode)} "
                     f"after '{_last_stage(fresh)}'")
        if model == "every_op":
            case = M.every_op(device)
            inputs = tmp_path / "inputs.pt"
            customops.export.save_inputs(case.inputs(6), inputs)
            c = run([customops.runner_path(), pt2, inputs, tmp_path / "outputs.pt"])
            notes.append(f"the same package in customops-run: {describe(c.returncode)}")
    pytest.fail(f"compile + aoti_load_package in one process ({device}, {model}) {describe(r.returncode)} "
                f"after '{_last_stage(r)}'\n" + "\n".join(notes) + f"\n--- stderr (tail) ---\n{r.stderr[-6000:]}")
