"""What the commands of ``python -m customops`` share, below all of them (it imports none): naming
the extra to install when an optional package a command needs is missing.
"""

from __future__ import annotations

import importlib
import sys

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
