"""Packaging models that call customops ops for Python-less inference (AOTInductor).

:func:`package` exports a model and compiles it into a ``.pt2`` package; :func:`save_inputs`
writes its inputs in the file format ``customops-run`` (:func:`customops.runner_path`) reads. A C++
process runs the package once libcustomops.so is loaded, e.g.::

    customops.export.package(model, (x,), "model.pt2", dynamic_shapes=({0: Dim("batch")},))
    customops.export.save_inputs((x,), "inputs.pt")
    # customops-run model.pt2 inputs.pt outputs.pt   (then torch.load("outputs.pt"))

:func:`package_causal_lm` packages a Hugging Face causal LM with its KV cache for text generation
(``customops-run generate``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

from . import _build_info

# Namespaces whose operators every libtorch + libcustomops process has registered.
_RUNNABLE_NAMESPACES = {"aten", "prims", "customops"}


def package(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    path: str | os.PathLike,
    *,
    dynamic_shapes: Any = None,
    size_oblivious: bool = True,
    inductor_configs: dict[str, Any] | None = None,
    optimize: bool = False,
) -> str:
    """Exports ``model`` with :func:`torch.export.export` and compiles it into an AOTInductor
    package with :func:`torch._inductor.aoti_compile_and_package`.

    The package is compiled for the device of ``example_inputs`` (and of the model's parameters)
    and runs in any process that has libcustomops.so loaded: ``customops-run``, a C++ program that
    links ``customops::customops``, or Python after ``import customops``. Its metadata records the
    customops and torch versions it was built with (``customops-run --info`` prints them).

    Args:
        model: Module whose forward takes tensors as positional arguments.
        example_inputs: Tuple of example positional inputs, on the target device.
        path: Where to write the package; by convention it ends in ``.pt2``.
        dynamic_shapes: As for :func:`torch.export.export`, e.g. ``({0: Dim("batch")},)`` for one
            input whose first dimension varies. Without it every shape is fixed.
        size_oblivious: Export without specializing dynamic sizes on 0 and 1
            (``torch.fx.experimental._config.backed_size_oblivious``), so the package accepts a
            batch of 1. Otherwise torch.export assumes every dynamic size is at least 2, and the
            package rejects a batch of 1 ("dim value is too small ... expected it to be >= 2").
            Turn it off if export fails with a data-dependent error under it.
        inductor_configs: Extra Inductor options, as for ``aoti_compile_and_package``.
        optimize: Apply :func:`customops.optimize` to ``model`` first (in place), so that a
            Hugging Face Llama, Mistral, Qwen2 or Qwen3 model's package calls customops ops
            (RMSNorm, SwiGLU, RoPE, residual add + norm). Export the model in eval mode.

    Returns:
        The package's path, as a string.

    Warns:
        UserWarning: when the exported program calls operators outside aten and customops,
        which a process with only libtorch and libcustomops.so loaded cannot find.
    """
    import torch.fx.experimental._config as fx_config

    if getattr(getattr(model, "config", None), "model_type", None) and hasattr(model, "lm_head") \
            and hasattr(model, "generate"):
        raise TypeError(f"customops.export.package: {type(model).__name__} is a Hugging Face causal LM, whose forward "
                        "returns its cache as an object export cannot write; package it with "
                        "customops.export.package_causal_lm(model, path), which keeps a static KV cache inside "
                        "the package for customops-run generate")
    if optimize:
        from .hf import optimize as optimize_model

        optimize_model(model, attention="sdpa")  # (not "auto": a package must not depend on this process's timings)
    # Inductor re-derives the size ranges when it compiles, so the setting covers both steps.
    with fx_config.patch(backed_size_oblivious=size_oblivious):
        ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
        return _compile(ep, path, inductor_configs)


def package_causal_lm(model: torch.nn.Module, path: str | os.PathLike, *, max_batch: int = 1, max_seq_len: int = 2048,
                      optimize: bool = True, inductor_configs: dict[str, Any] | None = None) -> str:
    """Packages a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3) with a static KV cache into
    one AOTInductor package for ``customops-run generate`` and the C++ generation API.

    The package holds the weights once and, per layer, a key and a value cache ``[max_batch,
    kv_heads, max_seq_len, head_dim]`` that its graph updates in place. Its forward takes
    ``input_ids [B, T]`` (int64, ``1 <= B <= max_batch``, ``T`` dynamic: a whole prompt, or 1 to
    decode), ``start [B]`` (each sequence's tokens already cached) and ``count [B]`` (how many of the
    ``T`` ids are the sequence's own; prompts of different lengths are right-padded) and returns
    the float32 logits of each sequence's last new token, ``[B, vocab]``
    (:class:`customops.causal_lm.CachedCausalLM`). Its metadata names the family, ``max_batch``,
    ``max_seq_len``, the vocabulary size, bos/eos/pad ids, the dtype, head dim, kv heads and layers, and
    the customops and torch versions.

    Args:
        model: A Hugging Face ``*ForCausalLM`` of those families, on the device and in the dtype the
            package is for (put it in eval mode; it is not modified).
        path: Where to write the package (``.pt2``).
        max_batch: Most sequences a call takes.
        max_seq_len: Most tokens (prompt and generated) a sequence holds.
        optimize: Call customops ops (rms_norm, rope, silu_mul) in the graph; always on (the
            package's layers are customops' own), kept for the signature's symmetry with
            :func:`package`.
        inductor_configs: Extra Inductor options, as for :func:`package`.

    Returns:
        The package's path, as a string.
    """
    import torch.fx.experimental._config as fx_config

    from .causal_lm import CachedCausalLM

    if max_batch < 1 or max_seq_len < 2:
        raise ValueError(f"customops.export.package_causal_lm: max_batch must be >= 1 and max_seq_len >= 2, "
                         f"got {max_batch} and {max_seq_len}")
    lm = CachedCausalLM(model, max_batch=max_batch, max_seq_len=max_seq_len).eval()
    device = next(model.parameters()).device
    cfg = model.config
    b = torch.export.Dim("batch", min=1, max=max_batch) if max_batch > 1 else None  # a Dim needs min < max
    t = torch.export.Dim("tokens", min=1, max=max_seq_len)
    example = (torch.zeros(min(2, max_batch), 2, dtype=torch.long, device=device),
               torch.zeros(min(2, max_batch), dtype=torch.long, device=device),
               torch.full((min(2, max_batch),), 2, dtype=torch.long, device=device))

    def token(name):
        v = getattr(cfg, name, None)
        if v is None:
            v = getattr(getattr(model, "generation_config", None), name, None)
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        return "" if v is None else str(int(v))

    configs = dict(inductor_configs or {})
    configs["aot_inductor.metadata"] = {
        **configs.get("aot_inductor.metadata", {}),
        "customops_causal_lm": "1", "family": lm.family, "max_batch": str(max_batch),
        "max_seq_len": str(max_seq_len), "vocab_size": str(cfg.vocab_size), "bos_token_id": token("bos_token_id"),
        "eos_token_id": token("eos_token_id"), "pad_token_id": token("pad_token_id"),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "device": device.type,
        "head_dim": str(lm.head_dim), "kv_heads": str(lm.n_kv), "layers": str(len(lm.layers))}
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        ep = torch.export.export(lm, example, dynamic_shapes=({0: b, 1: t}, {0: b}, {0: b}))
        return _compile(ep, path, configs)


def _compile(ep: torch.export.ExportedProgram, path, inductor_configs) -> str:
    foreign = sorted({
        str(node.target._schema.name)
        for node in ep.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace not in _RUNNABLE_NAMESPACES
    })
    if foreign:
        warnings.warn(
            f"customops.export.package: the model calls {', '.join(foreign)}; a process that runs "
            "the package must have the libraries registering them loaded too (customops-run has "
            "only libtorch and libcustomops.so)", stacklevel=3)
    configs = dict(inductor_configs or {})
    metadata = dict(configs.get("aot_inductor.metadata", {}))
    metadata.setdefault("customops_version", _build_info.version)
    metadata.setdefault("customops_torch_version", torch.__version__)
    configs["aot_inductor.metadata"] = metadata
    return torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path), inductor_configs=configs)


def save_inputs(inputs: Any, path: str | os.PathLike) -> None:
    """Writes a model's inputs in the format ``customops-run`` reads: :func:`torch.save` of a list of
    contiguous CPU tensors, flattened in the order torch.export flattens inputs.

    Args:
        inputs: A tensor, or a (nested) tuple or list of tensors, e.g. the ``example_inputs``
            given to :func:`package`. Tensors may be on any device: the runner moves them to the
            package's device.
        path: File to write.

    Raises:
        TypeError: if ``inputs`` holds something other than tensors.
    """
    leaves = tree_leaves(inputs)
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"customops.export.save_inputs: input {i} is a {type(x).__name__}, not a "
                            "tensor (an AOTInductor package takes tensors only)")
    torch.save([x.detach().cpu().contiguous() for x in leaves], os.fspath(path))


__all__ = ["package", "save_inputs"]
