"""Shared pytest fixtures: the devices to test (cpu, and cuda when customops was built with it), the
find_package(customops) consumer programs (tests/cpp/consumer) built once a session, and the small
Llama the generation tests package once a session."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import customops  # noqa: F401  (loads libcustomops.so)
from customops import testing

DEVICES = testing.devices()
CONSUMER_SRC = Path(__file__).resolve().parent.parent / "cpp" / "consumer"


@pytest.fixture(scope="session")
def consumer(request, tmp_path_factory) -> Path:
    """tests/cpp/consumer configured against the installed customops and built (incrementally,
    in pytest's cache folder, one a pytest-xdist worker, or in a temporary one under -p
    no:cacheprovider); returns its build folder (run_package, run_package_without_customops,
    generate_api, tokenize_api, engine_api, chat_template_api)."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    cache = getattr(request.config, "cache", None)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # (pytest-xdist: a folder a worker, never one build shared)
    build = Path(cache.mkdir(f"customops-consumer-{worker}" if worker else "customops-consumer")) if cache is not None \
        else tmp_path_factory.mktemp("consumer")
    prefix = ";".join([customops.cmake_prefix_path, torch.utils.cmake_prefix_path])
    configure = ["cmake", "-S", CONSUMER_SRC, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    targets = ["run_package", "run_package_without_customops", "generate_api", "tokenize_api", "engine_api",
               "chat_template_api"]
    for cmd in (configure, ["cmake", "--build", build, "--target", *targets]):
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return build


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def packaged(tmp_path_factory):
    """(model, path): causal_lms.llama() packaged for generation (max_batch 2, max_seq_len 24)."""
    pytest.importorskip("transformers")
    from causal_lms import MAX_BATCH, MAX_SEQ_LEN, llama

    model = llama()
    path = customops.export.package_causal_lm(model, tmp_path_factory.mktemp("lm") / "llama.pt2",
                                              max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    return model, path
