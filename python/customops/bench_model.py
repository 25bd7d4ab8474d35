"""``python -m customops bench --model llama``: a training step and an inference forward of Hugging
Face Llama (Llama-3.2-1B shapes by default), for eager, customops and the field's alternatives,
side by side in one run.

Every variant builds its own model from one seed (so their losses must agree and their peak
memory compares), warms up (compiles included) and is timed with CUDA events (wall clock on CPU).
Liger-Kernel patches transformers' classes for the whole process, so it runs last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Callable

import torch

import customops

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=131072)

OPT, CO = "customops.optimize", 'torch.compile(backend="customops")'
VARIANTS = ("eager", OPT, "liger", "torch.compile", f"{OPT} + torch.compile", CO, f"{OPT} + {CO[:-1]})")


def _liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model)
    return model


def _prepare(variant: str) -> Callable[[torch.nn.Module], torch.nn.Module]:
    def prep(m):
        if variant.startswith(OPT):
            m = customops.optimize(m)[0]
        if variant == "liger":
            m = _liger(m)
        if variant.endswith("+ torch.compile") or variant == "torch.compile":
            m = torch.compile(m)
        elif "backend=" in variant:
            m = torch.compile(m, backend="customops")
        return m
    return prep


def _timer(device: str):
    if device == "cuda":
        def time_ms(fn, iters):
            out = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b))
            return out
    else:
        def time_ms(fn, iters):
            out = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
            return out
    return time_ms


def _measure(variant: str, args, cfg_kw: dict) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    dev, dtype = args.device, (torch.float32 if args.amp else args.dtype)
    cfg = LlamaConfig(**cfg_kw, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype)
    model = _prepare(variant)(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.amp)
    time_ms = _timer(dev)
    losses = []

    def train_step():
        with amp:
            loss = model(ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        losses.append(loss.detach())

    model.train()
    for _ in range(args.warmup):
        train_step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step = time_ms(train_step, args.iters)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None

    model.eval()

    @torch.no_grad()
    def forward():
        with amp:
            model(ids)

    for _ in range(args.warmup):
        forward()
    infer = time_ms(forward, args.iters)
    ms = statistics.median(step)
    return {"variant": variant, "step_ms": ms, "tokens_per_s": args.batch * args.seq / ms * 1e3, "peak_gib": peak,
            "infer_ms": statistics.median(infer), "loss": losses[0].float().item()}


def run(args) -> dict:
    cfg_kw = dict(LLAMA_1B, num_hidden_layers=args.layers)
    for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "head_dim"):
        v = getattr(args, k)
        if v is not None:
            cfg_kw[{"hidden": "hidden_size", "intermediate": "intermediate_size", "heads": "num_attention_heads",
                    "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "head_dim": "head_dim"}[k]] = v
    if args.hidden is not None and args.head_dim is None:
        cfg_kw["head_dim"] = cfg_kw["hidden_size"] // cfg_kw["num_attention_heads"]
    wanted = [v.strip() for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"customops bench --model: unknown variant {unknown}; one of {', '.join(VARIANTS)}")
    order = [v for v in wanted if v != "liger"] + (["liger"] if "liger" in wanted else [])
    rows, notes = [], []
    for v in order:
        if v == "liger":
            try:
                import liger_kernel.transformers  # noqa: F401
            except Exception as e:  # noqa: BLE001
                notes.append(f"liger: not measured (Liger-Kernel not importable: {type(e).__name__})")
                continue
        if not args.no_progress:
            print(f"... {v}", flush=True)
        try:
            rows.append(_measure(v, args, cfg_kw))
            if not args.no_progress:
                r = rows[-1]
                print(f"    step {r['step_ms']:.1f} ms, peak {r['peak_gib'] or 0:.1f} GiB, inference {r['infer_ms']:.1f} ms, "
                      f"loss {r['loss']:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001  (a variant that fails is reported, the others still run)
            notes.append(f"{v}: failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
        torch._dynamo.reset()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: VARIANTS.index(r["variant"]))
    from .bench import _versions

    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": _versions(args.device),
            "config": {**cfg_kw, "batch": args.batch, "seq": args.seq,
                       "dtype": "float32 + autocast bf16" if args.amp else str(args.dtype).removeprefix("torch.")},
            "iters": args.iters}
    try:
        import transformers

        meta["versions"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    report = {"meta": meta, "rows": rows, "notes": notes}
    report["mismatches"] = _mismatches(report, args)
    report["targets"] = _targets(rows)
    return report


def _mismatches(report, args) -> list[str]:
    rows = {r["variant"]: r for r in report["rows"]}
    if "eager" not in rows:
        return []
    ref = rows["eager"]["loss"]
    rel = 1e-4 if args.dtype == torch.float32 and not args.amp else 2e-2
    return [f"{v}: loss {r['loss']:.5f} differs from eager's {ref:.5f}" for v, r in rows.items()
            if not abs(r["loss"] - ref) <= rel * abs(ref)]


def _targets(rows: list[dict]) -> list[dict]:
    by = {r["variant"]: r for r in rows}

    def best(names, key="step_ms"):
        have = [by[n] for n in names if n in by]
        return min(have, key=lambda r: r[key]) if have else None

    out = []
    ours, theirs = best([OPT, CO]), best(["liger", "torch.compile"])
    liger = by.get("liger")
    if ours and theirs and liger:
        speed = theirs["step_ms"] / ours["step_ms"]
        mem_ok = ours["peak_gib"] is None or ours["peak_gib"] <= liger["peak_gib"]
        out.append({"target": "training step: the faster of customops.optimize and the customops backend >= 1.05x the "
                              "faster of Liger-Kernel and torch.compile, peak memory <= Liger-Kernel's",
                    "met": speed >= 1.05 and mem_ok,
                    "measured": f"{ours['variant']} {speed:.2f}x {theirs['variant']}"
                                + (f", {ours['peak_gib']:.1f} vs {liger['peak_gib']:.1f} GiB" if ours["peak_gib"] else "")})
    else:
        out.append({"target": "training step vs Liger-Kernel and torch.compile", "met": None, "measured": "not measured"})
    a, b = by.get(f"{OPT} + torch.compile"), by.get("torch.compile")
    if a and b:
        mem_ok = a["peak_gib"] is None or a["peak_gib"] <= b["peak_gib"]
        out.append({"target": "customops.optimize + torch.compile faster than torch.compile, no more memory",
                    "met": a["step_ms"] < b["step_ms"] and mem_ok,
                    "measured": f"{b['step_ms'] / a['step_ms']:.2f}x"
                                + (f", {a['peak_gib']:.1f} vs {b['peak_gib']:.1f} GiB" if a["peak_gib"] else "")})
    else:
        out.append({"target": "customops.optimize + torch.compile vs torch.compile", "met": None, "measured": "not measured"})
    ours_i = best([v for v in VARIANTS if "customops" in v], "infer_ms")
    theirs_i = best(["liger", "torch.compile"], "infer_ms")
    if ours_i and theirs_i:
        out.append({"target": "inference forward no slower than the faster of Liger-Kernel and torch.compile",
                    "met": ours_i["infer_ms"] <= theirs_i["infer_ms"],
                    "measured": f"{ours_i['variant']} {theirs_i['infer_ms'] / ours_i['infer_ms']:.2f}x {theirs_i['variant']}"})
    else:
        out.append({"target": "inference forward vs Liger-Kernel and torch.compile", "met": None, "measured": "not measured"})
    return out


def markdown(report: dict) -> str:
    m = report["meta"]
    c = m["config"]
    eager = next((r for r in report["rows"] if r["variant"] == "eager"), None)
    lines = [f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
             f"Llama: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
             f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocabulary {c['vocab_size']}; batch "
             f"{c['batch']} x {c['seq']} tokens, {c['dtype']}. Training step = forward with labels + backward; "
             f"median of {m['iters']}.", "",
             "| variant | step ms | tokens/s | peak GiB | vs eager | inference ms | loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        vs = f"{eager['step_ms'] / r['step_ms']:.2f}x" if eager else ""
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {peak} | {vs} | "
                     f"{r['infer_ms']:.1f} | {r['loss']:.4f} |")
    lines.append("")
    for t in report["targets"]:
        mark = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"- {t['target']}: {mark} ({t['measured']})")
    for n in report["notes"] + [f"MISMATCH: {x}" for x in report["mismatches"]]:
        lines.append(f"- {n}")
    if report.get("command"):
        lines += ["", f"`{report['command']}`"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from .bench import DTYPES, update_doc

    p = argparse.ArgumentParser(prog="python -m customops bench --model llama", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["llama"], required=True)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--amp", action="store_true", help="float32 model, step under autocast(bfloat16)")
    for k in ("hidden", "intermediate", "heads", "kv-heads", "vocab", "head-dim"):
        p.add_argument(f"--{k}", type=int, help="override Llama-3.2-1B's")
    p.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--doc", metavar="PATH", help="write the table between <!-- bench:SECTION --> markers")
    p.add_argument("--section", default="llama")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and customops.build_info()["cuda"] else "cpu")
    args.dtype = DTYPES[args.dtype]
    report = run(args)
    report["command"] = "python -m customops bench " + " ".join(argv)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.doc:
        update_doc(args.doc, args.section, markdown(report))
    return 1 if report["mismatches"] or any("failed" in n for n in report["notes"]) else 0
