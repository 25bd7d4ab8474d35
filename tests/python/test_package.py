"""The package around the ops: loading, build info, the torch version check, linking, wrappers."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import customops


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
    runtime = re.compile(r"/lib(g|i|i5)?omp[^/]*\.so")  # libgomp, libomp, libiomp5
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if runtime.search(line)}
    assert len(runtimes) == 1, runtimes


def test_cmake_prefix_path_has_the_package_config():
    assert os.path.exists(os.path.join(customops.cmake_prefix_path, "customops", "customopsConfig.cmake"))


def test_wrappers_are_documented_and_exported():
    for name in ["muladd", "mul", "rms_norm", "silu", "silu_mul", "scale_clamp"]:
        fn = getattr(customops, name)
        assert name in customops.__all__
        assert fn.__doc__ and "Returns" in fn.__doc__, name


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
