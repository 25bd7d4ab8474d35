"""customops: fused PyTorch operators whose every registration lives in C++.

``import customops`` loads ``libcustomops.so`` once (through the ``customops._C`` extension,
which links it), after checking that the running torch is the one it was built against. The ops
are then reachable as ``torch.ops.customops.<name>`` and through the typed wrappers below.
"""

from __future__ import annotations

import os
import sys

import torch

from . import _build_info


def _check_torch_version() -> None:
    built = _build_info.torch_version
    running = torch.__version__
    if built and built != running:
        raise ImportError(
            f"customops {_build_info.version} was built against torch {built}, but torch {running} is "
            "installed; libcustomops.so is tied to the exact torch it was built with. Rebuild it "
            "against the installed torch: pip install --no-build-isolation --force-reinstall --no-deps ."
        )


_check_torch_version()

from . import _C  # noqa: E402  (loads libcustomops.so and registers the ops)
from . import export  # noqa: E402
from .hf import optimize  # noqa: E402
from ._ops import (add_rms_norm, attention, cache_attention, cache_write, cross_entropy, fused_linear,  # noqa: E402
                   linear_cross_entropy, merge_attention, mul, muladd, quantize_fp8, quantize_int4, rms_norm, rope, rope_cache_write,
                   scale_clamp, silu, silu_mul, swiglu)
from .distributed import _when_dtensor_loads  # noqa: E402

_when_dtensor_loads()  # DTensor sharding rules, registered when torch.distributed.tensor loads

__version__ = _build_info.version


# customops.compile (the "customops" torch.compile backend, explain) loads Dynamo and Inductor's
# pattern matcher, about 2 s: it is imported on first use, not by `import customops`.
# torch.compile(..., backend="customops") finds the backend through the torch_dynamo_backends
# entry point (pyproject.toml); when Dynamo is already loaded, importing customops registers it
# right away too.
def __getattr__(name: str):
    if name in ("explain", "compile"):
        import importlib

        module = importlib.import_module(".compile", __name__)  # not `from . import`: it asks __getattr__
        return module.explain if name == "explain" else module
    raise AttributeError(f"module 'customops' has no attribute {name!r}")


if "torch._dynamo" in sys.modules:
    from .compile import _register_backend

    _register_backend()

# Where the build's files (lib/, bin/, include/) lie: beside the _C extension, which is this
# folder in a wheel and site-packages/customops in an editable install (whose Python files stay in
# the checkout).
_installed = os.path.dirname(os.path.abspath(_C.__file__))

#: Folder to add to CMAKE_PREFIX_PATH for ``find_package(customops)``, like
#: ``torch.utils.cmake_prefix_path``.
cmake_prefix_path = os.path.join(_installed, "lib", "cmake")


def library_path() -> str:
    """Absolute path of the loaded ``libcustomops.so`` (e.g. for ``torch.ops.load_library`` in
    another process, or to link a C++ program against it)."""
    return _C.library_path()


def build_info() -> dict:
    """How the loaded library was built: customops and torch versions, CUDA version and
    architectures (empty when built without CUDA), compiler."""
    return dict(_C.build_info())


def runner_path() -> str:
    """Absolute path of ``customops-run``, the C++ program (no Python) that runs AOTInductor
    packages calling customops ops; see :mod:`customops.export` and ``customops-run --help``.

    Raises:
        FileNotFoundError: if this installation has no runner.
    """
    path = os.path.join(_installed, "bin", "customops-run")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"customops-run is not installed at {path}; reinstall customops "
                                "(pip install --no-build-isolation .)")
    return path


__all__ = [
    "muladd",
    "mul",
    "rms_norm",
    "silu",
    "silu_mul",
    "swiglu",
    "fused_linear",
    "quantize_fp8",
    "quantize_int4",
    "scale_clamp",
    "add_rms_norm",
    "rope",
    "cross_entropy",
    "linear_cross_entropy",
    "attention",
    "merge_attention",
    "cache_attention",
    "cache_write",
    "rope_cache_write",
    "explain",
    "optimize",
    "library_path", "build_info", "runner_path", "export", "cmake_prefix_path", "__version__"]
