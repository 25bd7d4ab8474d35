"""``python -m customops``: the live support matrix; ``python -m customops bench ...``: benchmarks.

The matrix checks every cell right then (nothing is read from a list): one row per op of the op
table, one column per capability. A failing cell shows why; the exit status is 0 only when every
applicable cell passes.
"""

from __future__ import annotations

import importlib
import sys

# Every subcommand, for `python -m customops --help`.
COMMANDS = """commands:
  python -m customops [options]     the live support matrix (this one)
  python -m customops bench [OP ...] [options]
                                    per-op benchmarks against eager, torch.compile and Liger-Kernel
                                    (needs the cli extra)
  python -m customops bench --model llama [options]
                                    a Hugging Face Llama training step and inference forward
                                    (needs the hf extra)
Each has its own --help."""

# The optional packages each extra of pyproject.toml installs.
EXTRAS = {"cli": ("rich", "tqdm", "matplotlib"), "hf": ("transformers",)}


def require(command: str, modules: dict[str, str]) -> None:
    """Exits with a one-line message naming the extra to install when one of `modules` (module ->
    extra) cannot be imported, before `command` starts any work."""
    for module, extra in modules.items():
        try:
            importlib.import_module(module)
        except ImportError:
            pkgs = " ".join(EXTRAS[extra])
            sys.exit(f"{command}: needs {module}, from customops' {extra} extra: pip install {pkgs} "
                     f"(or, in a customops checkout, pip install --no-build-isolation '.[{extra}]')")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    from .matrix import main as matrix_main

    return matrix_main(argv)


if __name__ == "__main__":
    sys.exit(main())
