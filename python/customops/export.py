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

import operator
import os
import tempfile
import warnings
import zipfile
from pathlib import Path
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
                      optimize: bool = True, inductor_configs: dict[str, Any] | None = None,
                      tokenizer: Any = None, weights: str = "bf16", quantize_lm_head: bool = False) -> str:
    """Packages a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3) with a static KV cache into
    one AOTInductor package for ``customops-run generate`` and the C++ generation API.

    The package holds the weights once and, per layer, a key and a value cache ``[max_batch,
    kv_heads, max_seq_len, head_dim]`` that its graph updates in place. Its forward takes
    ``input_ids [B, T]`` (int64, ``1 <= B <= max_batch``, ``T`` dynamic: a whole prompt, or 1 to
    decode), ``start [B]`` (each sequence's tokens already cached), ``count [B]`` (how many of the
    ``T`` ids are the sequence's own; prompts of different lengths are right-padded) and ``slots
    [B]`` (the cache row each sequence is, distinct, in ``[0, max_batch)``) and returns the float32
    logits of each sequence's last new token, ``[B, vocab]``
    (:class:`customops.causal_lm.CachedCausalLM`). Its metadata names the family, ``max_batch``,
    ``max_seq_len``, the vocabulary size, the bos and pad ids and every eos id (comma-separated;
    ``generation_config``'s, else the config's, as Hugging Face's ``generate`` takes them; ids
    outside the vocabulary are left out with a warning), the dtype, head dim, kv heads and layers,
    and the customops and torch versions. Rope types whose frequencies depend on the sequence's
    length ("dynamic", "longrope") are computed for each sequence from its own length.

    Args:
        model: A Hugging Face ``*ForCausalLM`` of those families, on the device and in the dtype the
            package is for (put it in eval mode; it is not modified).
        path: Where to write the package (``.pt2``).
        max_batch: Most sequences a call takes (an integer >= 1).
        max_seq_len: Most tokens (prompt and generated) a sequence holds (an integer >= 2).
        optimize: Call customops ops (rms_norm, rope, silu_mul) in the graph; always on (the
            package's layers are customops' own), kept for the signature's symmetry with
            :func:`package`.
        inductor_configs: Extra Inductor options, as for :func:`package`.
        tokenizer: The model's tokenizer, embedded so that one file serves (``customops-run serve``
            without ``--tokenizer``, ``customops-run generate --text``): a folder
            ``save_pretrained`` wrote (its tokenizer.json or tokenizer.model, tokenizer_config.json
            with the chat template and special tokens, chat_template.jinja), one tokenizer.json or
            tokenizer.model file, or a transformers tokenizer (saved with ``save_pretrained``).
            The metadata's ``tokenizer`` names the files.
        weights: The decoder layers' linear weights: ``"bf16"``, in the model's dtype (whatever it
            is); ``"fp8"``, float8 E4M3 with a float32 scale an output feature
            (:func:`customops.quantize_fp8`); ``"int4"``, int4 in groups of 128 inputs with a scale
            a group in the model's dtype (:func:`customops.quantize_int4`). Activations, norms, the
            embedding and the cache stay in the model's dtype. The metadata's ``weights`` names the
            format (``fp8``, ``int4``, or the model's dtype, ``bfloat16`` for example).
        quantize_lm_head: Quantize the LM head too, in ``weights``' format (else it stays in the model's
            dtype); with ``weights="bf16"`` it is an error.

    Returns:
        The package's path, as a string.

    Raises:
        ValueError: for a model of another family, without an LM head or on the meta device, an
            activation other than SwiGLU's, a sliding window that max_seq_len would reach, sizes
            that are not integers in range, a tokenizer that is none of the above, or weights that
            are not a format above (or int4 for in_features that are not a multiple of 128).
    """
    import torch.fx.experimental._config as fx_config

    from .causal_lm import CachedCausalLM

    def size(name, value, least):
        try:
            v = operator.index(value)  # an int, not a float or a bool
        except TypeError:
            v = None
        if v is None or isinstance(value, bool) or v < least:
            raise ValueError(f"customops.export.package_causal_lm: {name} must be an integer >= {least}, got {value!r}")
        return v

    max_batch, max_seq_len = size("max_batch", max_batch, 1), size("max_seq_len", max_seq_len, 2)
    tokenizer_files = None if tokenizer is None else _tokenizer_files(tokenizer)
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        raise ValueError("customops.export.package_causal_lm: the model's weights are on the meta device (not loaded); "
                         "load them (e.g. from_pretrained, or to_empty and load_state_dict) first")
    lm = CachedCausalLM(model, max_batch=max_batch, max_seq_len=max_seq_len, weights=weights,
                        quantize_lm_head=bool(quantize_lm_head)).eval()
    device = param.device
    cfg = model.config
    # (a Dim needs min < max)
    b = torch.export.Dim("batch", min=1, max=max_batch) if max_batch > 1 else torch.export.Dim.STATIC
    t = torch.export.Dim("tokens", min=1, max=max_seq_len)
    example = (torch.zeros(min(2, max_batch), 2, dtype=torch.long, device=device),
               torch.zeros(min(2, max_batch), dtype=torch.long, device=device),
               torch.full((min(2, max_batch),), 2, dtype=torch.long, device=device),
               torch.arange(min(2, max_batch), dtype=torch.long, device=device))

    def tokens(name):
        """The ids of a special token as Hugging Face's generate takes them (generation_config's,
        else the config's), those inside the vocabulary, comma-separated (eos may list several)."""
        v = getattr(getattr(model, "generation_config", None), name, None)
        if v is None:
            v = getattr(cfg, name, None)
        ids = [int(i) for i in (v if isinstance(v, (list, tuple)) else [] if v is None else [v])]
        outside = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if outside:
            warnings.warn(f"customops.export.package_causal_lm: {name} {outside} is outside the vocabulary "
                          f"[0, {cfg.vocab_size}); the package leaves it out", stacklevel=3)
        return ",".join(str(i) for i in ids if i not in outside)

    configs = dict(inductor_configs or {})
    # cos, sin and the lengths feed every layer's rope_cache_write and cache_attention. Too cheap for
    # Inductor's reuse heuristic to compute once, each extern call got its own copy: on the CPU one
    # kernel writing 8 copies of each for 4 layers, on CUDA kernels recomputing them in some layers
    # (ncu, Llama-3.2-1B, 2026-11-28). Realizing what several nodes read computes each once.
    configs.setdefault("realize_reads_threshold", 0)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    stored = dtype if weights == "bf16" else weights
    configs["aot_inductor.metadata"] = {
        **configs.get("aot_inductor.metadata", {}),
        # "3": the format (T = 1 in the token dimension's declared range, eos a list of ids, slots)
        "customops_causal_lm": "3", "family": lm.family, "max_batch": str(max_batch),
        "max_seq_len": str(max_seq_len), "vocab_size": str(cfg.vocab_size), "bos_token_id": tokens("bos_token_id"),
        "eos_token_id": tokens("eos_token_id"), "pad_token_id": tokens("pad_token_id"),
        "dtype": dtype, "device": device.type,
        "head_dim": str(lm.head_dim), "kv_heads": str(lm.n_kv), "layers": str(len(lm.layers)),
        # what the weights are stored as: "fp8", "int4", or (unquantized) the model's dtype
        "weights": stored, "lm_head_weights": stored if quantize_lm_head else dtype}
    if tokenizer_files:
        configs["aot_inductor.metadata"]["tokenizer"] = ",".join(sorted(tokenizer_files))
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        ep = torch.export.export(lm, example, dynamic_shapes=({0: b, 1: t}, {0: b}, {0: b}, {0: b}))
        out = _compile(ep, path, configs)
    if tokenizer_files:
        _embed(out, _TOKENIZER_FOLDER, tokenizer_files)
    return out


# Where a package holds its tokenizer (in its archive's top folder; customops-run reads it there),
# and the files of a save_pretrained folder that customops-run reads.
_TOKENIZER_FOLDER = "extra/customops/tokenizer/"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja")


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files of the tokenizer package_causal_lm embeds, by name: see its ``tokenizer``."""
    where = "customops.export.package_causal_lm: tokenizer"
    if isinstance(tokenizer, torch.nn.Module):
        raise ValueError(f"{where} is a model ({type(tokenizer).__name__}), not a tokenizer")
    if hasattr(tokenizer, "save_pretrained"):
        with tempfile.TemporaryDirectory() as d:
            tokenizer.save_pretrained(d)
            return _tokenizer_files(d)
    try:
        p = Path(tokenizer)
    except TypeError:
        raise ValueError(f"{where} must be a path or a transformers tokenizer, got a {type(tokenizer).__name__}") from None
    if p.is_dir():
        files = {n: (p / n).read_bytes() for n in _TOKENIZER_FILES if (p / n).is_file()}
        if "tokenizer.json" not in files and "tokenizer.model" not in files:
            raise ValueError(f"{where}: the folder {p} holds neither a tokenizer.json nor a tokenizer.model")
        return files
    if p.is_file() and (p.name.endswith("tokenizer.json") or p.suffix == ".model"):
        return {"tokenizer" + p.suffix: p.read_bytes()}
    raise ValueError(f"{where}: {p} is not a tokenizer.json, a tokenizer.model or a folder holding one")


def _embed(package_path: str, folder: str, files: dict[str, bytes]) -> None:
    """Adds files to a package's zip archive, under folder in its top folder (stored, as torch
    stores every member: customops-run checks their CRC-32s)."""
    with zipfile.ZipFile(package_path, "a") as z:
        top = z.namelist()[0].split("/", 1)[0]
        for name, data in files.items():
            z.writestr(f"{top}/{folder}{name}", data, compress_type=zipfile.ZIP_STORED)


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
