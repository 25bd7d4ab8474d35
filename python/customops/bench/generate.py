"""``python -m customops bench --generate``: text generation with Hugging Face causal LMs, Python's
``generate`` against ``customops-run generate`` on a package_causal_lm package, side by side.

Every variant generates greedily from the same random-weight model for prompts of ``--prompt-len``
random ids, batch 1 and 8. ``--models`` names the models, each put through all of it in turn: the
shapes of a model of each family package_causal_lm supports (``llama-3.2-1b``, the default,
``llama-3-8b``, ``qwen2.5-1.5b``, ``qwen3-1.7b``, ``mistral-7b``: bench/model.py's MODELS) with
``--layers`` decoder layers (16) in bfloat16 on CUDA; on CPU a small float32 model of the same
family (Qwen2's q, k and v biases, Qwen3's q and k norms, the real model's tied or untied embedding).
Prefill tokens/s comes from a generation of one token; decode ms/token from the difference between
``--new-tokens`` tokens and one, over the extra tokens. The runner reports its own prefill and
decode times (stderr). The floor is the bytes a decode step must read (the weights once, an untied
input embedding a row a token, plus the KV cache at the mean length) at the device-to-device copy
speed, measured once in the run.

``--weights bf16,fp8,int4`` adds ``customops-run generate`` of a package of each quantized format
(``package_causal_lm(..., weights=...)``), each against the floor of its own bytes: its decoder
layers' weights at one byte (fp8) or half a byte (int4) an element, with their scales
(``--quantize-lm-head``: the LM head's too, ``quantize_lm_head=True``).

``--variant VAR=VALUE[,VAR=VALUE]`` (repeatable) runs ``customops-run generate`` of every format
again with those environment variables set: an experiment switch of a kernel, side by side with
the default.

With ``--rounds R`` every variant is timed once a round, in turn, R rounds: a variant's numbers are
its medians, and its speed against eager the median of the rounds' ratios, so that a host whose
speed drifts during the run (a shared CPU machine) moves both sides of each ratio together.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

import customops

from .. import _cli
from .attention import parse_variant, variant_label
from .common import pick_device, versions, write_json
from .model import MODELS

SMALL = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=4096)
VARIANTS = ("eager", "customops.optimize", "static cache + torch.compile", "customops-run generate",
            "customops-run generate --no-cuda-graph")


def _model(args, name: str = "llama-3.2-1b"):
    import transformers

    arch, kw = MODELS[name]
    if args.device != "cuda":  # SMALL in the family's classes (its biases and norms), tied or not as the real one
        kw = dict(SMALL, **{k: kw[k] for k in ("tie_word_embeddings", "sliding_window") if k in kw})
    cfg = getattr(transformers, arch + "Config")(**kw, num_hidden_layers=args.layers, attn_implementation="sdpa",
                                                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = getattr(transformers, arch + "ForCausalLM")(cfg).to(
            torch.bfloat16 if args.device == "cuda" else torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_times(model, ids, new_tokens, device, **kw) -> tuple[float, float]:
    """(prefill tokens/s, decode ms/token) of model.generate, the better of 2 after a warm-up."""

    def timed(n):
        ts = []
        for _ in range(3):
            _sync(device)
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               attention_mask=torch.ones_like(ids), **kw)
            _sync(device)
            ts.append(time.perf_counter() - t)
        return min(ts[1:])  # the first is a warm-up

    one, many = timed(1), timed(new_tokens)
    return ids.numel() / one, (many - one) / (new_tokens - 1) * 1e3


def _runner_times(path, ids, new_tokens, *extra, runs=2, env=None) -> tuple[float, float]:
    cmd = [customops.runner_path(), "generate", path, "--max-new-tokens", str(new_tokens), "--ignore-eos", *extra]
    for row in ids.tolist():
        cmd += ["--prompt", " ".join(map(str, row))]
    best = None
    for _ in range(runs):  # each run loads the package and warms up: its times are its second call's
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env} if env else None)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        prefill = float(re.search(r"\(([\d.]+) tokens/s\)", r.stderr).group(1))
        decode = float(re.search(r"\(([\d.]+) ms/token", r.stderr).group(1))
        if best is None or decode < best[1]:
            best = (prefill, decode)
    return best


def _copy_speed(device) -> float:
    """Memory bandwidth (read + write bytes a second) of a large copy on the device."""
    a = torch.ones(2**28 if device == "cuda" else 2**25, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    _sync(device)
    return 2 * a.numel() * 4 * 20 / (time.perf_counter() - t)


def _quantized(shape, dtype_size: int, weights: str) -> float:
    """The bytes of an [n, k] weight in a quantized format, with its scales."""
    from .. import causal_lm

    n, k = shape
    return n * k + 4 * n if weights == "fp8" else n * k / 2 + n * (k // causal_lm.INT4_GROUP) * dtype_size


def _weight_bytes(model, weights: str, lm_head: bool = False) -> float:
    """The bytes of the model's weights as a package of this format reads them a decode step: the
    decoder layers' linear weights quantized (fp8: a byte an element and a float32 scale a row;
    int4: half a byte and a scale in the model's dtype a group of INT4_GROUP), everything else as
    it is (their biases, Qwen2's q, k and v ones; Qwen3's q and k norms), but for an untied input
    embedding, whose lookup reads a row a token. parameters() counts a tied embedding once: the LM
    head reads it whole (quantized too with lm_head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    if weights == "bf16":
        return total
    for layer in model.model.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            w = m.weight
            total += _quantized(w.shape, w.element_size(), weights) - w.numel() * w.element_size()
    if lm_head:
        w = model.get_output_embeddings().weight
        total += _quantized(w.shape, w.element_size(), weights) - w.numel() * w.element_size()
    return total


def run(args) -> dict:
    names = [n.strip() for n in args.models.split(",")]
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise SystemExit(f"bench --generate: --models takes {', '.join(MODELS)}, not {', '.join(bad)}")
    wanted = [v.strip() for v in args.variants.split(",")] if args.variants else [
        v for v in VARIANTS if args.device == "cuda" or "cuda-graph" not in v]
    formats = [w.strip() for w in args.weights.split(",")]
    bad = [w for w in formats if w not in ("bf16", "fp8", "int4")]
    if bad:
        raise SystemExit(f"bench --generate: --weights takes bf16, fp8 and int4, not {', '.join(bad)}")
    # a quantized package of each other format: customops-run generate of it, against its own floor
    head = " and LM head" if args.quantize_lm_head else ""
    quantized = {f"customops-run generate, {w} weights{head}": w for w in formats if w != "bf16"}
    # each --variant: customops-run generate of every format again, with its variables set
    runners = [v for v in wanted if v == "customops-run generate"] + list(quantized)
    envs = {f"{v} [{variant_label(e)}]": (v, e) for e in args.variant for v in runners}
    speed = _copy_speed(args.device)
    rows, notes, metas = [], [], {}
    for name in names:
        metas[name], model_rows, model_notes = _run_model(args, name, wanted + list(quantized) + list(envs), quantized,
                                                          envs, speed)
        rows += model_rows
        notes += model_notes
        gc.collect()  # the model and its variants' copies leave the device before the next is built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": versions(args.device),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "copy_gb_s": speed / 1e9,
            "rounds": args.rounds, "models": metas}
    return {"meta": meta, "rows": rows, "notes": notes}


def _run_model(args, name: str, wanted: list[str], quantized: dict[str, str], envs: dict[str, tuple[str, dict]],
               speed: float) -> tuple[dict, list[dict], list[str]]:
    """The meta, rows and notes of one model of MODELS: every variant of wanted at every batch
    (envs: an environment variant's runner variant and variables)."""
    model = _model(args, name)
    cfg = model.config
    batches = [int(b) for b in args.batches.split(",")]
    max_seq_len = args.prompt_len + args.new_tokens
    g = torch.Generator().manual_seed(1)
    rows, notes = [], []
    weight_bytes = {w: _weight_bytes(model, w, lm_head=args.quantize_lm_head and w != "bf16")
                    for w in ("bf16", *quantized.values())}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2's config has none
    # keys and values of every layer a sequence at the mean length, in the model's dtype
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (args.prompt_len + args.new_tokens / 2) \
        * next(model.parameters()).element_size()
    floors = {w: {b: (n + b * kv) / speed * 1e3 for b in batches} for w, n in weight_bytes.items()}
    package = None
    if any(v.startswith("customops-run") and envs.get(v, (v,))[0] not in quantized for v in wanted):
        t = time.perf_counter()
        package = customops.export.package_causal_lm(model, tempfile.mkdtemp() + f"/{name}.pt2", max_batch=max(batches),
                                                     max_seq_len=max_seq_len)
        notes.append(f"package_causal_lm of {name}: {time.perf_counter() - t:.0f} s (max_batch {max(batches)}, "
                     f"max_seq_len {max_seq_len})")
    packages = {}
    for v, w in quantized.items():
        packages[v] = customops.export.package_causal_lm(model, tempfile.mkdtemp() + f"/{name}-{w}.pt2",
                                                         max_batch=max(batches), max_seq_len=max_seq_len, weights=w,
                                                         quantize_lm_head=args.quantize_lm_head)
    for b in batches:
        ids = torch.randint(1, cfg.vocab_size, (b, args.prompt_len), generator=g).to(args.device)
        floor = {v: floors[quantized.get(envs[v][0] if v in envs else v, "bf16")][b] for v in wanted}
        times = {v: [] for v in wanted}  # (prefill, decode) a round
        errors = {}
        models = {}  # the variants' models, built at their first round

        def measure(v):
            if v == "eager":
                return _hf_times(model, ids, args.new_tokens, args.device)
            if v == "customops.optimize":
                if v not in models:
                    models[v] = customops.optimize(_model(args, name))[0].eval()
                return _hf_times(models[v], ids, args.new_tokens, args.device)
            if v == "static cache + torch.compile":
                if v not in models:
                    models[v] = _model(args, name)
                    models[v].forward = torch.compile(models[v].forward, mode="reduce-overhead", fullgraph=True)
                return _hf_times(models[v], ids, args.new_tokens, args.device, cache_implementation="static")
            runs = 1 if args.rounds > 1 else 2
            if v in envs:
                base, env = envs[v]
                return _runner_times(packages.get(base, package), ids.cpu(), args.new_tokens, runs=runs, env=env)
            if v in packages:
                return _runner_times(packages[v], ids.cpu(), args.new_tokens, runs=runs)
            return _runner_times(package, ids.cpu(), args.new_tokens, *v.split()[2:], runs=runs)

        for rnd in range(args.rounds):
            for v in wanted:
                if v in errors:
                    continue
                if not args.no_progress:
                    print(f"... {name}, batch {b}" + (f", round {rnd + 1}/{args.rounds}" if args.rounds > 1 else "")
                          + f": {v}", flush=True)
                try:
                    pre, dec = measure(v)
                    times[v].append((pre, dec))
                    if not args.no_progress:
                        print(f"    prefill {pre:,.0f} tokens/s, decode {dec:.2f} ms/token (floor "
                              f"{floor[v]:.2f})", flush=True)
                except Exception as e:  # noqa: BLE001  (a variant that fails is reported, the others run)
                    msg = (str(e).strip().splitlines() or [""])[0][:200]
                    errors[v] = f"{type(e).__name__}: {msg}"
        eager = [d for _, d in times.get("eager", [])]
        for v in wanted:
            if v in errors:
                rows.append({"model": name, "variant": v, "batch": b, "error": errors[v], "floor_ms": floor[v]})
                continue
            row = {"model": name, "variant": v, "batch": b,
                   "prefill_tokens_per_s": statistics.median(p for p, _ in times[v]),
                   "decode_ms": statistics.median(d for _, d in times[v]), "floor_ms": floor[v],
                   "rounds": [{"prefill_tokens_per_s": p, "decode_ms": d} for p, d in times[v]]}
            if len(eager) == len(times[v]):  # eager's decode time over this variant's, round by round
                ratios = [e / d for e, d in zip(eager, (d for _, d in times[v]))]
                row["vs_eager"] = statistics.median(ratios)
                row["vs_eager_range"] = [min(ratios), max(ratios)]
            rows.append(row)
        models.clear()
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    meta = {"family": cfg.model_type, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "weight_gb": {w: n / 1e9 for w, n in weight_bytes.items()}, "floor_ms": floors}
    return meta, rows, notes


def print_report(report: dict) -> None:
    m = report["meta"]
    print(f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    print(f"prompt {m['prompt_len']}, {m['new_tokens']} greedy new tokens; copy speed {m['copy_gb_s']:.0f} GB/s; "
          "floor: the weights a decode step reads and the mean KV cache at the copy speed, a quantized package's "
          "against its own bytes")
    for name, mm in m["models"].items():
        floors = "; ".join(f"{w} {gb:.2f} GB, floor " + ", ".join(f"batch {b} {f:.2f} ms" for b, f in
                                                              mm["floor_ms"][w].items())
                           for w, gb in mm["weight_gb"].items())
        print(f"{name} ({mm['family']}): {mm['layers']} layers, hidden {mm['hidden']}, vocabulary {mm['vocab']}; "
              f"{floors}")
    w = max([38] + [len(r["variant"]) for r in report["rows"]])  # (a --variant's name is longer)
    print(f"{'variant':{w}s} {'model':13s} {'batch':>5s} {'prefill tok/s':>14s} {'decode ms/tok':>14s} {'x floor':>8s} "
          f"{'vs eager':>9s}")
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['variant']:{w}s} {r['model']:13s} {r['batch']:5d}  {r['error']}")
            continue
        spread = f"  ({r['vs_eager_range'][0]:.2f}-{r['vs_eager_range'][1]:.2f}x)" if len(r["rounds"]) > 1 and \
            "vs_eager_range" in r and r["variant"] != "eager" else ""
        vs = f"{r['vs_eager']:8.2f}x" if "vs_eager" in r else f"{'-':>9s}"  # (eager not among the variants)
        print(f"{r['variant']:{w}s} {r['model']:13s} {r['batch']:5d} {r['prefill_tokens_per_s']:14,.0f} "
              f"{r['decode_ms']:14.2f} {r['decode_ms'] / r['floor_ms']:7.2f}x {vs}{spread}")
    if m.get("rounds", 1) > 1:
        print(f"medians of {m['rounds']} rounds, each timing every variant in turn; vs eager: the median of the "
              "rounds' ratios (their range in brackets)")
    for n in report["notes"]:
        print(n)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--generate", action="store_true", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--models", default="llama-3.2-1b", help=f"comma-separated, each measured in turn: "
                   f"{', '.join(MODELS)} (their shapes on CUDA, a small model of the family on CPU)")
    p.add_argument("--layers", type=int, help="decoder layers (default: 16 on CUDA, 4 on CPU)")
    p.add_argument("--prompt-len", type=int, help="default: 512 on CUDA, 64 on CPU")
    p.add_argument("--new-tokens", type=int, help="default: 256 on CUDA, 32 on CPU")
    p.add_argument("--batches", default=None, help="comma-separated (default: 1,8 on CUDA, 1 on CPU)")
    p.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="the quantized formats' packages quantize the LM head too (its floor with it)")
    p.add_argument("--weights", default="bf16", help="comma-separated package weight formats: bf16 (the model's "
                   "dtype), fp8, int4; each beyond bf16 adds customops-run generate of such a package")
    p.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="customops-run generate of every format again with these environment variables (an "
                   "experiment switch); repeatable")
    p.add_argument("--rounds", type=int, help="time every variant in turn this many times, report medians "
                   "(default: 1 on CUDA, 5 on CPU)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _cli.require("python -m customops bench --generate", {"transformers": "hf"})
    args.device = pick_device(p, args.device)
    cuda = args.device == "cuda"
    args.layers = args.layers or (16 if cuda else 4)
    args.prompt_len = args.prompt_len or (512 if cuda else 64)
    args.new_tokens = args.new_tokens or (256 if cuda else 32)
    args.batches = args.batches or ("1,8" if cuda else "1")
    args.rounds = args.rounds or (1 if cuda else 5)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    report = run(args)
    print_report(report)
    write_json(args.json, report)
    return 1 if any("error" in r for r in report["rows"] if r["variant"] != "static cache + torch.compile") else 0
