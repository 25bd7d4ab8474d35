"""The op benchmarks' report: the table printed with rich, the bar chart of effective bandwidth
(PNG), and the device's section of docs/benchmarks.md (Markdown).
"""

from __future__ import annotations

import itertools

from .op_table import ALTERNATIVES, IMPL_LABEL, IMPLS, OVERHEAD_MAX, PASSES


def _fmt_ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.2f} ms"


def _shape(r: dict) -> str:
    return "x".join(map(str, r["shape"]))


AGAINST_LABEL = {"eager": "eager", "compile": "torch.compile", "liger": "Liger-Kernel", "copy": "copy bandwidth",
                 "liger_memory": "Liger-Kernel's peak memory over customops'"}


def _flops_column(report: dict) -> tuple:
    return (("TFLOP/s", "right"),) if any("tflops" in r for r in report["rows"]) else ()


def _tflops_cell(r: dict) -> str:
    return f"{r['tflops']:.3g}" if "tflops" in r else ""


def _peak_cell(r: dict) -> str:
    return "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"


def _speedup_cell(rows_of_case: list[dict], r: dict) -> str:
    if r["impl"] not in ALTERNATIVES:
        return ""
    base = next(x for x in rows_of_case if x["impl"] == "customops")
    return f"{base['speedup'][r['impl']]:.2f}x"


def _groups(rows: list[dict]):
    key = lambda r: (r["op"], _shape(r), r["dtype"], r["pass"])  # noqa: E731
    for k, g in itertools.groupby(rows, key):
        yield k, list(g)


def _target_line(t: dict) -> str:
    v = f"{100 * t['value']:.0f}% of" if t["against"] == "copy" else f"{t['value']:.2f}x"
    against = " and ".join(AGAINST_LABEL[a] for a in t["compared"])
    if len(t["compared"]) > 1:
        against = f"the faster of {against}"
    want = f"{100 * t['at_least']:.0f}%" if t["against"] == "copy" else f"{t['at_least']}x"
    return (f"{t['op']} {'x'.join(map(str, t['shape']))} {t['dtype']} {t['pass']}: {v} {against} "
            f"(target >= {want}): {'met' if t['met'] else 'NOT met'}")


def _header(report: dict) -> str:
    m, v = report["meta"], report["meta"]["versions"]
    extra = "".join(f", {k} {v[k]}" for k in ("triton", "liger_kernel") if k in v)
    env = "".join(f" | {k}={val}" for k, val in m.get("env", {}).items())
    return (f"{m['device_name']} ({m['device']}, {m['threads']} threads) | torch {v['torch']}, customops "
            f"{v['customops']}{extra} | {m['date']}{env}{' | --quick: timings not meaningful' if m['quick'] else ''}")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    c = report["copy"]
    t = Table(title=_header(report), title_justify="left")
    for col, just in (("op", "left"), ("shape", "left"), ("dtype", "left"), ("pass", "left"), ("impl", "left"),
                      ("median", "right"), ("GB/s", "right"), ("% of copy", "right"),
                      ("customops speed-up", "right"), ("peak MiB", "right")) + _flops_column(report):
        t.add_column(col, justify=just)
    for _, g in _groups(report["rows"]):
        for i, r in enumerate(g):
            sp = _speedup_cell(g, r)
            if sp:
                sp = f"[{'green' if float(sp[:-1]) >= 1 else 'red'}]{sp}[/]"
            first = i == 0
            t.add_row(r["op"] if first else "", _shape(r) if first else "", r["dtype"] if first else "",
                      r["pass"] if first else "", IMPL_LABEL[r["impl"]], _fmt_ms(r["median_ms"]),
                      f"{r['gbps']:.1f}", f"{r['pct_of_copy']:.0f}%", sp, _peak_cell(r),
                      *([_tflops_cell(r)] if _flops_column(report) else []),
                      style="bold" if r["impl"] == "customops" else None, end_section=i == len(g) - 1)
    console.print(t)
    console.print(f"copy roofline: dst.copy_(src), {c['bytes'] / 2**20:.0f} MiB moved: {c['gbps']:.1f} GB/s (median of "
                  f"{c['comparisons']} comparisons, {c['gbps_range'][0]:.1f} to {c['gbps_range'][1]:.1f}); each row's "
                  "% of copy is against the copy timed with it", highlight=False)
    if report["overhead"]:
        t = Table(title=f"per-call overhead on tiny tensors (limit: {OVERHEAD_MAX}x the ATen op)", title_justify="left")
        for col in ("op", "path", "requires_grad", "customops", "ATen op", "ATen", "ratio"):
            t.add_column(col, justify="right" if col in ("customops", "ATen", "ratio") else "left")
        for r in report["overhead"]:
            ratio = f"[{'green' if r['within_limit'] else 'red'}]{r['ratio']:.2f}x[/]"
            t.add_row(r["op"], r["path"], str(r["requires_grad"]), f"{r['customops_us']:.2f} µs", r["aten"],
                      f"{r['aten_us']:.2f} µs", ratio)
        console.print(t)
    for tg in report["targets"]:
        console.print(("[green]" if tg["met"] else "[red]") + _target_line(tg) + "[/]", highlight=False)
    for n in report["notes"]:
        console.print(f"[dim]note: {n}[/]", highlight=False)
    for n in report["failures"]:
        console.print(f"[bold red]FAILED: {n}[/]", highlight=False)


def plot(report: dict, path: str) -> None:
    """Bar chart of effective bandwidth per case and implementation, with the copy roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [p for p in PASSES if any(r["pass"] == p for r in report["rows"])]
    fig, axes = plt.subplots(len(passes) or 1, 1, figsize=(11, 3.6 * max(1, len(passes))), squeeze=False)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in report["rows"])]
    colors = dict(zip(IMPLS, ("tab:blue", "tab:cyan", "tab:gray", "tab:orange", "tab:green", "tab:purple")))
    for ax, p in zip(axes[:, 0], passes):
        groups = [(k, g) for k, g in _groups(report["rows"]) if k[3] == p]
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            xs, ys, pct = [], [], []
            for i, (_, g) in enumerate(groups):
                for r in g:
                    if r["impl"] == impl:
                        xs.append(i + (j - (len(impls) - 1) / 2) * width)
                        ys.append(r["gbps"])
                        pct.append(f"{r['pct_of_copy']:.0f}%")
            bars = ax.bar(xs, ys, width, label=IMPL_LABEL[impl], color=colors[impl])
            ax.bar_label(bars, pct, fontsize=7, padding=1)
        for i, (_, g) in enumerate(groups):  # the copy timed with this comparison
            ax.hlines(g[0]["copy_gbps"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                      label="copy" if i == 0 else None)
        ax.set_xticks(range(len(groups)), [f"{k[0]}\n{k[1]} {k[2]}" for k, _ in groups], fontsize=8)
        ax.set_xlim(-0.5, max(len(groups), 2) - 0.5)
        ax.set_ylim(0, 1.15 * max(max(r["copy_gbps"], r["gbps"]) for _, g in groups for r in g))
        ax.set_ylabel("effective GB/s (labels: % of copy)")
        ax.set_title(p, fontsize=10, loc="left")
    axes[0, 0].legend(fontsize=8, loc="upper right", ncols=len(impls) + 1)
    fig.suptitle(_header(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict, image: str | None = None) -> str:
    """The device's section of docs/benchmarks.md."""
    m, v, c = report["meta"], report["meta"]["versions"], report["copy"]
    extra = "".join(f", {k} {v[k]}" for k in ("triton", "liger_kernel") if k in v)
    lines = [
        f"**{m['device_name']}** ({m['threads']} threads), torch {v['torch']}, customops {v['customops']}{extra}, "
        f"{m['date']}. Timer: {m['timer']}.",
        "",
        f"Generated by `{m['command'] or 'python -m customops bench'}`.",
        "",
        f"Copy roofline (`dst.copy_(src)`, {c['bytes'] / 2**20:.0f} MiB moved, timed within every comparison): "
        f"**{c['gbps']:.1f} GB/s** (median; {c['gbps_range'][0]:.1f} to {c['gbps_range'][1]:.1f}). Each row's "
        "% of copy is against the copy timed alongside it.",
        "",
        "| op | shape | dtype | pass | impl | median | GB/s | % of copy | customops speed-up | peak MiB |"
        + (" TFLOP/s |" if _flops_column(report) else ""),
        "|---|---|---|---|---|--:|--:|--:|--:|--:|" + ("--:|" if _flops_column(report) else ""),
    ]
    for _, g in _groups(report["rows"]):
        for r in g:
            name = f"**{IMPL_LABEL[r['impl']]}**" if r["impl"] == "customops" else IMPL_LABEL[r["impl"]]
            lines.append(f"| {r['op']} | {_shape(r)} | {r['dtype']} | {r['pass']} | {name} | {_fmt_ms(r['median_ms'])} "
                         f"| {r['gbps']:.1f} | {r['pct_of_copy']:.0f}% | {_speedup_cell(g, r)} | {_peak_cell(r)} |"
                         + (f" {_tflops_cell(r)} |" if _flops_column(report) else ""))
    if image:
        lines += ["", f"![effective bandwidth, {m['device_name']}]({image})"]
    if report["overhead"]:
        lines += ["", f"Per-call overhead on tiny tensors (limit {OVERHEAD_MAX}x the ATen op):", "",
                  "| op | path | requires_grad | customops | ATen op | ATen | ratio |", "|---|---|---|--:|---|--:|--:|"]
        for r in report["overhead"]:
            flag = "" if r["within_limit"] else " (over)"
            lines.append(f"| {r['op']} | {r['path']} | {r['requires_grad']} | {r['customops_us']:.2f} µs | "
                         f"`{r['aten']}` | {r['aten_us']:.2f} µs | {r['ratio']:.2f}x{flag} |")
    if report["targets"]:
        lines += ["", "Targets:", ""] + [f"- {_target_line(t)}" for t in report["targets"]]
    if report["notes"] or report["failures"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]] + [f"- FAILED: {n}" for n in report["failures"]]
    return "\n".join(lines)
