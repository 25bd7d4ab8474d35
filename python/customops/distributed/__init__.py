"""customops past one device: DTensor sharding rules for customops' ops (:mod:`.sharding`) and
ring attention over a sequence sharded across ranks (:mod:`.ring`).

DTensor finds a sharding strategy for every op it runs; customops' are registered in
:mod:`.sharding` once ``torch.distributed.tensor`` is imported (by the user, torch or anyone), so
``import customops`` neither imports DTensor (about a second) nor needs it, and a program that uses
DTensor needs no call of its own. :func:`register_sharding_rules` registers them at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from .ring import gather_sequence, ring_attention, shard_sequence

_DTENSOR = "torch.distributed.tensor"


def register_sharding_rules() -> None:
    """Registers the DTensor sharding rules of every customops op (idempotent). Imports
    ``torch.distributed.tensor``."""
    from . import sharding  # noqa: F401  (importing it registers them)


def _register_quietly() -> None:
    try:
        register_sharding_rules()
    except Exception as e:  # a DTensor that changed its API must not break the import of the user's program
        warnings.warn(f"customops: DTensor sharding rules not registered ({type(e).__name__}: {e}); "
                      "customops ops on DTensors will raise DTensor's own error", stacklevel=2)


class _AfterDTensorImport(importlib.abc.MetaPathFinder):
    """Registers the rules right after ``torch.distributed.tensor`` is first imported: finds its
    spec with the other finders and runs the registration once the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_quietly()

        loader.exec_module = exec_then_register
        return spec


def _when_dtensor_loads() -> None:
    """Called by ``import customops``: registers the rules now if DTensor is loaded, else on its
    import; nothing where torch.distributed is not built in."""
    import torch.distributed

    if not torch.distributed.is_available():
        return
    if _DTENSOR in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _AfterDTensorImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDTensorImport())


__all__ = ["register_sharding_rules", "ring_attention", "shard_sequence", "gather_sequence"]
