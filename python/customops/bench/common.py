"""What the benchmark families share: the dtype names of their options, the device to run on,
the versions and CPU a report records, and writing a report into a Markdown file's section.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import customops


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def pick_device(parser: argparse.ArgumentParser, requested: str | None) -> str:
    """The device to run on: the one asked for, else cuda when customops was built with it and a
    GPU is there, else cpu. Exits through ``parser.error`` when cuda is asked for but unusable."""
    cuda_ok = torch.cuda.is_available() and customops.build_info()["cuda"]
    device = requested or ("cuda" if cuda_ok else "cpu")
    if device == "cuda" and not cuda_ok:
        parser.error("--device cuda: " + ("customops was built without CUDA" if torch.cuda.is_available()
                                          else "no CUDA device is available"))
    return device


def versions(device: str) -> dict:
    v = {"torch": torch.__version__, "customops": customops.__version__, "python": platform.python_version()}
    if device != "cuda":
        return v
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    for mod, dist in (("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:
            m = importlib.import_module(mod)
        except Exception:
            continue
        try:
            v[mod] = version(dist)
        except PackageNotFoundError:  # e.g. a source tree on PYTHONPATH
            v[mod] = getattr(m, "__version__", "unknown version")
    return v


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def update_doc(path: str, name: str, section: str) -> None:
    """Replaces what lies between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in path."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    with open(path) as f:
        text = f.read()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"customops bench: --doc {path} has no '{begin}' ... '{end}' markers to write between")
    with open(path, "w") as f:
        f.write(text[: i + len(begin)] + "\n" + section + "\n" + text[j:])


def write_json(path: str | None, report) -> None:
    """A family's report as JSON at path (--json), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
