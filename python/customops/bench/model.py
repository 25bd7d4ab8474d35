"""``python -m customops bench --model llama``: a training step and an inference forward of Hugging
Face Llama (Llama-3.2-1B shapes by default), for eager, customops and the field's alternatives,
side by side in one run.

Every variant builds its own model from one seed (so their losses must agree and their peak
memory compares), warms up (compiles included) and is timed with CUDA events (wall clock on CPU).
Liger-Kernel's apply_liger_kernel_to_llama replaces transformers' module-level Llama classes and
forward for the whole process (every model built later would be Liger's), so it runs last.
A variant whose piece is missing (Liger-Kernel, customops.optimize, the "customops" backend) is
skipped with a note; one that fails, or a loss that differs from eager's, makes the exit status 1.

With ``--fsdp`` every variant is sharded with FSDP2 as torchtitan does it (``fully_shard`` per
decoder layer, then the root; torch.compile per decoder layer), each rank training on its own
batch: run under ``torchrun --nproc-per-node N`` for N GPUs (tokens/s and peak memory are per GPU,
rank 0 reports); a plain process forms a group of one.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Callable

import torch
import torch._dynamo

import customops

from .. import _cli
from .common import DTYPES, pick_device, update_doc, versions, write_json
from .timers import iteration_timer


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=131072)

# The Hugging Face architecture and config of each family's model that package_causal_lm supports
# (bench --generate --models); the benches set the number of layers.
MODELS = {
    "llama-3.2-1b": ("Llama", LLAMA_1B),
    "llama-3-8b": ("Llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192)),
    # Qwen2's config has no head_dim (hidden / heads = 128); its q, k and v projections have biases
    "qwen2.5-1.5b": ("Qwen2", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, max_position_embeddings=32768)),
    "qwen3-1.7b": ("Qwen3", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
                                 rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960)),
    "mistral-7b": ("Mistral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, vocab_size=32000, rope_theta=1e6,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                                   max_position_embeddings=32768)),
}

OPT, CO = "customops.optimize", 'torch.compile(backend="customops")'
OPT_ATTN = f'{OPT}(attention="customops")'  # customops' attention in place of SDPA
OPT_SDPA = f'{OPT}(attention="sdpa")'  # SDPA kept (optimize's default, "auto", times the two per shape class)
VARIANTS = ("eager", OPT, OPT_SDPA, OPT_ATTN, "liger", "torch.compile", f"{OPT} + torch.compile", CO, f"{OPT} + {CO[:-1]})")


def _liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model)
    return model


class _Skip(Exception):
    """The variant's piece is not in this installation: reported as not measured, not as failed."""


def _prepare(variant: str, fsdp: bool = False) -> Callable[[torch.nn.Module], torch.nn.Module]:
    if variant.startswith(OPT) and not hasattr(customops, "optimize"):
        raise _Skip("this customops has no optimize")

    def compile_(m, **kw):
        if not fsdp:
            return torch.compile(m, **kw)
        for layer in m.model.layers:  # FSDP2's hooks stay outside the compiled layers, as torchtitan's
            layer.compile(**kw)
        return m

    def prep(m):
        if variant.startswith(OPT):
            attention = {OPT_ATTN: "customops", OPT_SDPA: "sdpa"}.get(variant)
            m = customops.optimize(m, **({"attention": attention} if attention else {}))[0]
        if variant == "liger":
            m = _liger(m)
        if variant.endswith("+ torch.compile") or variant == "torch.compile":
            m = compile_(m)
        elif "backend=" in variant:
            try:
                torch._dynamo.lookup_backend("customops")
            except torch._dynamo.exc.InvalidBackend as e:
                raise _Skip('torch.compile has no "customops" backend') from e
            m = compile_(m, backend="customops")
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in m.model.layers:
                fully_shard(layer)
            fully_shard(m)
        return m
    return prep


def _join_group(device: str) -> tuple[int, int]:
    """(rank, world) of the FSDP2 group: torchrun's, or a group of one."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def _measure(variant: str, args, cfg_kw: dict) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    dev, dtype = args.device, (torch.float32 if args.amp else args.dtype)
    cfg = LlamaConfig(**cfg_kw, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype)
    model = _prepare(variant, args.fsdp)(model)
    g = torch.Generator(device="cpu").manual_seed(1 + args.rank)  # each rank its own batch
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.amp)
    time_ms = iteration_timer(dev)
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
    args.rank, args.world = _join_group(args.device) if args.fsdp else (0, 1)
    if args.rank:
        args.no_progress = True
    cfg_kw = dict(LLAMA_1B, num_hidden_layers=args.layers)
    for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "head_dim"):
        v = getattr(args, k)
        if v is not None:
            cfg_kw[{"hidden": "hidden_size", "intermediate": "intermediate_size", "heads": "num_attention_heads",
                    "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "head_dim": "head_dim"}[k]] = v
    if (args.hidden is not None or args.heads is not None) and args.head_dim is None:
        cfg_kw["head_dim"] = cfg_kw["hidden_size"] // cfg_kw["num_attention_heads"]
    wanted = [v.strip() for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"customops bench --model: unknown variant {unknown}; one of {', '.join(VARIANTS)}")
    order = [v for v in wanted if v != "liger"] + (["liger"] if "liger" in wanted else [])
    measured: dict[str, list[dict]] = {}
    notes, failures, dropped = [], [], set()
    for rnd in range(args.rounds):
        for v in order:
            # Liger-Kernel patches transformers for the whole process: its one measurement comes last
            if v in dropped or (v == "liger" and rnd < args.rounds - 1):
                continue
            if v == "liger":
                try:
                    import liger_kernel.transformers  # noqa: F401
                except Exception as e:  # noqa: BLE001
                    notes.append(f"liger: not measured (Liger-Kernel not importable: {type(e).__name__})")
                    continue
            if not args.no_progress:
                print(f"... {v}" + (f", round {rnd + 1}/{args.rounds}" if args.rounds > 1 and v != "liger" else ""),
                      flush=True)
            try:
                measured.setdefault(v, []).append(_measure(v, args, cfg_kw))
                if not args.no_progress:
                    r = measured[v][-1]
                    print(f"    step {r['step_ms']:.1f} ms, peak {_peak(r)}{' GiB' * (r['peak_gib'] is not None)}, "
                          f"inference {r['infer_ms']:.1f} ms, loss {r['loss']:.4f}", flush=True)
            except _Skip as e:
                notes.append(f"{v}: not measured ({e})")
                dropped.add(v)
            except Exception as e:  # noqa: BLE001  (a variant that fails is reported, the others still run)
                failures.append(f"{v}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                dropped.add(v)
            torch._dynamo.reset()
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    rows = [_combine(rs, args) for v, rs in measured.items() if v not in dropped]
    rows.sort(key=lambda r: VARIANTS.index(r["variant"]))
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": versions(args.device),
            "config": {**cfg_kw, "batch": args.batch, "seq": args.seq,
                       "dtype": "float32 + autocast bf16" if args.amp else str(args.dtype).removeprefix("torch.")},
            "iters": args.iters, "rounds": args.rounds, "fsdp": args.world if args.fsdp else None}
    try:
        import transformers

        meta["versions"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    report = {"meta": meta, "rows": rows, "notes": notes, "failures": failures}
    report["mismatches"] = _mismatches(report, args)
    report["targets"] = _targets(rows)
    return report


def _combine(rs: list[dict], args) -> dict:
    """A variant's row over its rounds: the medians of the rounds' step and inference times, the highest
    peak, the first round's loss (every round builds the same model from one seed), and the rounds."""
    if len(rs) == 1:
        return rs[0]
    step = statistics.median(r["step_ms"] for r in rs)
    peaks = [r["peak_gib"] for r in rs if r["peak_gib"] is not None]
    return {**rs[0], "step_ms": step, "tokens_per_s": args.batch * args.seq / step * 1e3,
            "peak_gib": max(peaks) if peaks else None, "infer_ms": statistics.median(r["infer_ms"] for r in rs),
            "rounds": [{"step_ms": r["step_ms"], "infer_ms": r["infer_ms"]} for r in rs]}


def _mismatches(report, args) -> list[str]:
    rows = {r["variant"]: r for r in report["rows"]}
    if "eager" not in rows:
        return []
    ref = rows["eager"]["loss"]
    rel = 1e-4 if args.dtype == torch.float32 and not args.amp else 2e-2
    # not (<=) so that a NaN loss is a mismatch too
    return [f"{v}: loss {r['loss']:.5f} differs from eager's {ref:.5f} by more than {rel:g} relative"
            for v, r in rows.items() if not abs(r["loss"] - ref) <= rel * abs(ref)]


def _targets(rows: list[dict]) -> list[dict]:
    """The issue's three goals; met is None (not measured) while a variant they compare is missing."""
    by = {r["variant"]: r for r in rows}

    def best(names, key="step_ms"):
        have = [by[n] for n in names if n in by]
        return min(have, key=lambda r: r[key]) if have else None

    def missing(*groups):
        # a group is measured when any of its variants is; ("liger",) already says ("liger", "torch.compile")'s
        gone = [set(g) for g in groups if not any(n in by for n in g)]
        return ["customops variant" if len(g) > 2 else " or ".join(sorted(g)) for g in gone
                if not any(h < g for h in gone)]

    def gib(a, b):
        return f", {a['peak_gib']:.1f} vs {b['peak_gib']:.1f} GiB" if a["peak_gib"] is not None else ""

    def mem_ok(a, b):  # on CPU there is no peak to compare
        return a["peak_gib"] is None or b["peak_gib"] is None or a["peak_gib"] <= b["peak_gib"]

    out = []
    groups = ((OPT, CO), ("liger", "torch.compile"), ("liger",))  # Liger-Kernel's peak is the memory bar
    t = {"target": "training step: the faster of customops.optimize and the customops backend >= 1.05x the faster "
                   "of Liger-Kernel and torch.compile, peak memory <= Liger-Kernel's", "met": None}
    if missing(*groups):
        t["measured"] = f"not measured (no {', no '.join(missing(*groups))})"
    else:
        ours, theirs, liger = best(groups[0]), best(groups[1]), by["liger"]
        speed = theirs["step_ms"] / ours["step_ms"]
        t["met"] = speed >= 1.05 and mem_ok(ours, liger)
        t["measured"] = f"{ours['variant']} {speed:.2f}x {theirs['variant']}{gib(ours, liger)}"
    out.append(t)

    groups = ((f"{OPT} + torch.compile",), ("torch.compile",))
    t = {"target": "customops.optimize + torch.compile faster than torch.compile, no more peak memory", "met": None}
    if missing(*groups):
        t["measured"] = f"not measured (no {', no '.join(missing(*groups))})"
    else:
        a, b = by[groups[0][0]], by["torch.compile"]
        t["met"] = a["step_ms"] < b["step_ms"] and mem_ok(a, b)
        t["measured"] = f"{b['step_ms'] / a['step_ms']:.2f}x{gib(a, b)}"
    out.append(t)

    groups = (tuple(v for v in VARIANTS if "customops" in v), ("liger", "torch.compile"))
    t = {"target": "inference forward of the best customops variant no slower than the faster of Liger-Kernel and "
                   "torch.compile", "met": None}
    if missing(*groups):
        t["measured"] = f"not measured (no {', no '.join(missing(*groups))})"
    else:
        ours, theirs = best(groups[0], "infer_ms"), best(groups[1], "infer_ms")
        t["met"] = ours["infer_ms"] <= theirs["infer_ms"]
        t["measured"] = f"{ours['variant']} {theirs['infer_ms'] / ours['infer_ms']:.2f}x {theirs['variant']}"
    out.append(t)
    return out


def _peak(r: dict) -> str:
    return f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"


def _cells(report: dict) -> list[list[str]]:
    """The table's rows: variant, step ms, tokens/s, peak GiB, speed-up over eager's step, inference ms, loss."""
    eager = next((r for r in report["rows"] if r["variant"] == "eager"), None)
    return [[r["variant"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", _peak(r),
             f"{eager['step_ms'] / r['step_ms']:.2f}x" if eager else "", f"{r['infer_ms']:.1f}", f"{r['loss']:.4f}"]
            for r in report["rows"]]


COLUMNS = ("variant", "step ms", "tokens/s", "peak GiB", "vs eager", "inference ms", "loss")


def _target_line(t: dict) -> str:
    mark = "·" if t["met"] is None else ("✓" if t["met"] else "✗")
    return f"{mark} {t['target']}: {t['measured']}"


def _header(report: dict) -> list[str]:
    m, c = report["meta"], report["meta"]["config"]
    return ([f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
            f"Llama: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocabulary {c['vocab_size']}; batch "
            f"{c['batch']} x {c['seq']} tokens, {c['dtype']}. Training step = forward with labels + backward; "
            f"median of {m['iters']}" + (f"; medians of {m['rounds']} rounds, each building and timing every variant "
                                         f"in turn (Liger-Kernel's once, last)." if m.get("rounds", 1) > 1 else ".")]
            + ([f"FSDP2 over {m['fsdp']} GPU(s) (fully_shard per decoder layer, then the root; compiled per layer), "
               f"batch and tokens/s per GPU."] if m.get("fsdp") else []))


def print_report(report: dict) -> None:
    """The table (rich when installed, else plain text), then targets, notes, failures and mismatches."""
    lines = [_target_line(t) for t in report["targets"]] + [f"note: {n}" for n in report["notes"]]
    bad = [f"FAILED: {n}" for n in report["failures"]] + [f"MISMATCH: {n}" for n in report["mismatches"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        rows = [list(COLUMNS)] + _cells(report)
        w = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        print("\n".join(_header(report)))
        for k, r in enumerate(rows):
            print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
            if k == 0:
                print("  ".join("-" * n for n in w))
        print("\n".join(lines + bad))
        return
    console = Console(width=max(120, Console().width))
    for line in _header(report):
        console.print(line, highlight=False)
    t = Table()
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "variant" else "right", no_wrap=True)
    for r in _cells(report):
        t.add_row(*r, style="bold" if "customops" in r[0] else None)
    console.print(t)
    for tg, line in zip(report["targets"], lines):
        console.print(("[dim]" if tg["met"] is None else "[green]" if tg["met"] else "[red]") + line + "[/]",
                      highlight=False)
    for line in lines[len(report["targets"]):]:
        console.print(f"[dim]{line}[/]", highlight=False)
    for line in bad:
        console.print(f"[bold red]{line}[/]", highlight=False)


def markdown(report: dict) -> str:
    """The --doc section: the same table and lines in Markdown."""
    lines = [*_header(report), "", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in _cells(report)]
    lines.append("")
    lines += [f"- {_target_line(t)}" for t in report["targets"]]
    lines += [f"- {n}" for n in report["notes"]] + [f"- FAILED: {n}" for n in report["failures"]]
    lines += [f"- MISMATCH: {n}" for n in report["mismatches"]]
    if report.get("command"):
        lines += ["", f"`{report['command']}`"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --model llama",
                                description="Training step and inference forward of Hugging Face Llama (built from a "
                                            "config, Llama-3.2-1B shapes unless overridden) for eager, customops, "
                                            "Liger-Kernel and torch.compile.")
    p.add_argument("--model", choices=["llama"], required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the model's dtype (default: bfloat16)")
    p.add_argument("--amp", action="store_true", help="float32 model, step under autocast(bfloat16)")
    for k in ("hidden", "intermediate", "heads", "kv-heads", "vocab", "head-dim"):
        p.add_argument(f"--{k}", type=int, help="override Llama-3.2-1B's (head-dim: hidden / heads when either is given)"
                       if k == "head-dim" else "override Llama-3.2-1B's")
    p.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per pass, median reported (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first, compilation included (default: 3)")
    p.add_argument("--rounds", type=int, default=1, help="build and time every variant in turn this many times, "
                   "report medians: a slow spell of the machine falls on all variants (default: 1)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--doc", metavar="PATH", help="write the table between <!-- bench:SECTION --> markers")
    p.add_argument("--section", default="llama", help="the markers --doc writes between (default: llama)")
    p.add_argument("--no-progress", action="store_true", help="no per-variant progress lines")
    p.add_argument("--fsdp", action="store_true", help="shard every variant with FSDP2 over the ranks of torchrun "
                   "(tokens/s and peak memory per GPU), or a group of one without it")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    _cli.require("python -m customops bench --model llama", {"transformers": "hf"})
    args.device = pick_device(p, args.device)
    args.dtype = DTYPES[args.dtype]
    report = run(args)
    report["command"] = "python -m customops bench " + " ".join(argv)
    if args.rank:  # rank 0 reports
        return 1 if report["mismatches"] or report["failures"] else 0
    print_report(report)
    write_json(args.json, report)
    if args.doc:
        update_doc(args.doc, args.section, markdown(report))
    return 1 if report["mismatches"] or report["failures"] else 0
