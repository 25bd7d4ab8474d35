"""Smoke test of ``python -m customops bench --quick``: the report's structure, never its timings."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from customops.bench import op_table, ops


def test_registry_rows_name_ops_of_the_library():
    library = {n.removeprefix("customops::").partition(".")[0] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("customops::")}
    benched = {b.op for b in op_table.BENCHES}
    assert benched and benched <= library
    assert benched <= set(op_table.BENCHES_BY_NAME)  # each benched op has a row under its own name


def test_bench_quick_report(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# before\n<!-- bench:cpu -->\nold\n<!-- /bench:cpu -->\n# after\n")
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "muladd", "--quick", "--device", "cpu", "--no-progress",
         "--json", "report.json", "--plot", "chart.png", "--doc", str(doc)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "customops speed-up" in out.stdout and "copy roofline" in out.stdout

    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"meta", "copy", "rows", "overhead", "targets", "notes", "failures"}
    assert report["failures"] == []
    assert report["meta"]["device"] == "cpu" and report["meta"]["quick"] is True
    assert report["copy"]["gbps"] > 0 and report["copy"]["bytes"] > 0

    rows = report["rows"]
    assert {r["op"] for r in rows} == {"muladd"}
    for p in ("fwd", "fwd+bwd"):
        impls = {r["impl"] for r in rows if r["pass"] == p}
        assert {"customops", "eager", "compile"} <= impls and "liger" not in impls
    for r in rows:
        assert {"shape", "dtype", "median_ms", "p10_ms", "p90_ms", "bytes", "gbps", "pct_of_copy"} <= set(r)
        assert r["median_ms"] > 0 and r["bytes"] > 0
    n = rows[0]["shape"][0]
    fwd = next(r for r in rows if r["impl"] == "customops" and r["pass"] == "fwd")
    assert fwd["bytes"] == 3 * 4 * n  # reads a and b, writes the result, float32
    assert set(fwd["speedup"]) == {"eager", "compile"}

    assert {(o["path"], o["requires_grad"]) for o in report["overhead"]} == {
        (p, g) for p in ("python", "torch.ops") for g in (False, True)}
    assert all({"customops_us", "aten_us", "ratio", "within_limit"} <= set(o) for o in report["overhead"])
    assert {t["against"] for t in report["targets"]} == {"eager", "compile"}  # muladd's CPU targets
    assert any("Liger-Kernel" in n for n in report["notes"])

    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = doc.read_text()
    assert text.startswith("# before\n<!-- bench:cpu -->\n") and text.endswith("<!-- /bench:cpu -->\n# after\n")
    assert "| muladd |" in text and "old" not in text


def test_bench_tuple_outputs_and_no_grad_inputs():
    # add_rms_norm returns (y, sum): both get an output gradient; rope's cos and sin take none.
    report = ops.run(["add_rms_norm", "rope"], device="cpu", quick=True, progress=False)
    assert report["failures"] == []
    for op in ("add_rms_norm", "rope"):
        passes = {r["pass"] for r in report["rows"] if r["op"] == op and r["impl"] == "customops"}
        assert passes == {"fwd", "fwd+bwd"}, (op, passes)
    assert all(r["peak_mib"] is None for r in report["rows"])  # CUDA only


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "customops", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m customops bench [OP ...]" in out.stdout and "bench --model llama" in out.stdout
    for family in ("--generate", "--decode", "--attention", "--ring", "--linear"):
        assert f"python -m customops bench {family}" in out.stdout, family


def test_a_missing_extra_is_named_before_any_work():
    # tqdm hidden as if the cli extra were not installed (None in sys.modules fails its import)
    code = ("import sys; sys.modules['tqdm'] = None; from customops.__main__ import main; "
            "sys.exit(main(['bench', 'muladd', '--quick', '--device', 'cpu']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip() == ("python -m customops bench: needs tqdm, from customops' cli extra: pip install rich "
                                  "tqdm matplotlib (or, in a customops checkout, pip install --no-build-isolation "
                                  "'.[cli]')"), out.stderr
    assert "customops speed-up" not in out.stdout


def test_bench_attention_report(tmp_path):
    """--attention: both implementations timed forward and forward+backward at the shapes asked for,
    with TFLOP/s, the ratio to SDPA and the errors against SDPA in float32."""
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "--attention", "--device", "cpu", "--quick", "--no-progress",
         "--shapes", "1,4,2,64,32,causal,float32", "1,2,2,48,16,full,bfloat16", "--json", "report.json",
         "--variant", "CUSTOMOPS_ATTENTION_WS=0,CUSTOMOPS_ATTENTION_SM80=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "target forward >= 1.0x SDPA" in out.stdout and "B1 Hq4 Hkv2 S64 D32 causal float32" in out.stdout
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [(r["hq"], r["hkv"], r["causal"], r["dtype"]) for r in rows] == [(4, 2, True, "float32"),
                                                                          (2, 2, False, "bfloat16")]
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            assert r[f"{mode}_customops_ms"] > 0 and r[f"{mode}_sdpa_ms"] > 0
            assert r[f"{mode}_vs_sdpa"] == r[f"{mode}_sdpa_ms"] / r[f"{mode}_customops_ms"]
        assert r["max_err_customops"] < (1e-5 if r["dtype"] == "float32" else 5e-2), r
        # the variant (environment switches of kernel paths) timed in the same run, named with the
        # switch to our backward that a variant of its paths gets
        name = "customops[CUSTOMOPS_ATTENTION_WS=0,CUSTOMOPS_ATTENTION_SM80=1,CUSTOMOPS_ATTENTION_BWD_CUDNN=0]"
        assert r[f"fwd_bwd_{name}_ms"] > 0 and r[f"max_err_{name}"] < (1e-5 if r["dtype"] == "float32" else 5e-2)
        assert r[f"fwd_{name}_vs_sdpa"] == r["fwd_sdpa_ms"] / r[f"fwd_{name}_ms"]
    assert f"{name}, in the same run:" in out.stdout
    # a variant of our backward's paths runs our backward (a loss of out alone takes cuDNN's at some shapes)
    from customops.bench.attention import _with_our_backward

    assert _with_our_backward({"CUSTOMOPS_ATTENTION_BWD_DQ": "pass"}) == {
        "CUSTOMOPS_ATTENTION_BWD_DQ": "pass", "CUSTOMOPS_ATTENTION_BWD_CUDNN": "0"}
    assert _with_our_backward({"CUSTOMOPS_ATTENTION_SM80": "1"})["CUSTOMOPS_ATTENTION_BWD_CUDNN"] == "0"
    for env in ({"CUSTOMOPS_ATTENTION_WS": "0"}, {"CUSTOMOPS_ATTENTION_BWD_CUDNN": "1"}):
        assert _with_our_backward(env) == env
    bad = subprocess.run([sys.executable, "-m", "customops", "bench", "--attention", "--shapes", "1,2,2,8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected B,Hq,Hkv,S,D,causal|full,dtype" in bad.stderr, bad.stderr


def test_bench_generate_rounds_report(tmp_path):
    """--rounds times each variant once a round, in turn: medians, and eager's ratio round by round."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "--generate", "--device", "cpu", "--variants", "eager",
         "--rounds", "3", "--layers", "1", "--prompt-len", "8", "--new-tokens", "3", "--no-progress",
         "--json", "report.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "medians of 3 rounds" in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["rounds"] == 3
    [row] = report["rows"]
    assert row["variant"] == "eager" and len(row["rounds"]) == 3 and row["vs_eager"] == 1.0
    assert row["decode_ms"] == sorted(r["decode_ms"] for r in row["rounds"])[1]


def test_bench_generate_times_a_quantized_package_against_its_own_floor(tmp_path):
    """--weights int4: customops-run generate of an int4 package beside eager, its floor the int4
    package's bytes (its decoder layers' weights at half a byte an element, with their scales).
    --variant runs it again with the variables set: a good value beside its default, a bad one
    the runner's own error (so the variables reach it)."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "--generate", "--device", "cpu", "--variants", "eager",
         "--weights", "bf16,int4", "--layers", "1", "--prompt-len", "8", "--new-tokens", "3", "--no-progress",
         "--variant", "CUSTOMOPS_PREFILL_MULTIPLE=4", "--variant", "CUSTOMOPS_PREFILL_MULTIPLE=x",
         "--json", "report.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr  # (the bad variant's row is an error)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    int4 = "customops-run generate, int4 weights"
    assert set(rows) == {"eager", int4, f"{int4} [CUSTOMOPS_PREFILL_MULTIPLE=4]",
                         f"{int4} [CUSTOMOPS_PREFILL_MULTIPLE=x]"}, rows
    q = rows[int4]
    assert "error" not in q and q["decode_ms"] > 0, q
    assert q["floor_ms"] < rows["eager"]["floor_ms"]  # fewer bytes a step
    padded = rows[f"{int4} [CUSTOMOPS_PREFILL_MULTIPLE=4]"]
    assert "error" not in padded and padded["decode_ms"] > 0 and padded["floor_ms"] == q["floor_ms"], padded
    assert "CUSTOMOPS_PREFILL_MULTIPLE must be a count" in rows[f"{int4} [CUSTOMOPS_PREFILL_MULTIPLE=x]"]["error"]


def test_bench_generate_quantizes_the_lm_head_when_asked(tmp_path):
    """--quantize-lm-head: the int4 package quantizes its LM head too, and its floor counts the head
    at int4 (the bench's CPU model ties it to the embedding: 4096 x 256 of its bytes)."""
    pytest.importorskip("transformers")
    from customops.bench import generate

    model = generate._model(argparse.Namespace(device="cpu", layers=1))
    head = model.get_output_embeddings().weight
    saved = head.numel() * head.element_size() - generate._quantized(head.shape, head.element_size(), "int4")
    assert generate._weight_bytes(model, "int4", lm_head=True) == generate._weight_bytes(model, "int4") - saved
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "--generate", "--device", "cpu", "--variants", "eager",
         "--weights", "bf16,int4", "--quantize-lm-head", "--layers", "1", "--prompt-len", "8", "--new-tokens", "3",
         "--no-progress", "--json", "report.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["variant"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    q = rows["customops-run generate, int4 weights and LM head"]
    assert "error" not in q and q["decode_ms"] > 0, q


def test_bench_generate_report_without_eager_says_so(capsys):
    """A run without the eager variant has no ratio to eager: the column says '-', not nanx."""
    from customops.bench import generate

    row = {"model": "m", "variant": "customops-run generate", "batch": 1, "prefill_tokens_per_s": 1000.0,
           "decode_ms": 2.0, "floor_ms": 1.0, "rounds": [{"prefill_tokens_per_s": 1000.0, "decode_ms": 2.0}]}
    meta = {"device": "cpu", "versions": {}, "prompt_len": 8, "new_tokens": 3, "copy_gb_s": 10.0,
            "models": {"m": {"family": "llama", "layers": 1, "hidden": 8, "vocab": 16, "weight_gb": {"bf16": 0.1},
                             "floor_ms": {"bf16": {1: 1.0}}}}}
    generate.print_report({"meta": meta, "rows": [row], "notes": []})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.split()[-1] == "-" and "nan" not in line, line


def test_bench_serve_report_with_a_variant(tmp_path):
    """--serve at one client: the server's row beside generate's, and again under --variant's
    environment (the server process gets the variables), the timed requests and generate sampling
    with --temperature's options; --llama-cpp without a built llama-server is refused before any
    work."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "-m", "customops", "bench", "--serve", "--device", "cpu", "--layers", "1", "--prompt-len", "8",
         "--new-tokens", "3", "--concurrency", "1", "--requests", "1", "--variant", "CUSTOMOPS_BENCH_PROBE=1",
         "--temperature", "1.5", "--top-k", "20", "--top-p", "0.9", "--no-progress", "--json", "report.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["sampling"] == {"temperature": 1.5, "top_k": 20, "top_p": 0.9}
    assert "3 new tokens sampled (temperature 1.5, top_k 20, top_p 0.9) each" in out.stdout, out.stdout
    [row] = report["rows"]
    assert row["serve"]["requests"] == 1 and row["generate"]["tokens_per_s"] > 0, row
    assert 0 < row["serve"]["server_ttft_mean_ms"] <= row["serve"]["ttft_p99_ms"], row
    assert row["serve"]["server_queue_mean_ms"] >= 0 and row["serve"]["server_prefill_mean_ms"] > 0, row
    assert row["variants"]["CUSTOMOPS_BENCH_PROBE=1"]["requests"] == 1, row
    assert "[CUSTOMOPS_BENCH_PROBE=1]" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "customops", "bench", "--serve", "--device", "cpu", "--llama-cpp",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and f"--llama-cpp: no build/bin/llama-server in {tmp_path}" in bad.stderr, bad.stderr


def test_bench_serve_prompt_lengths():
    """Mixed lengths from a quarter to all of --prompt-len; with --same-length all of it."""
    from customops.bench import serve
    mixed = serve.prompt_lengths(64, False, 200, torch.Generator().manual_seed(0))
    assert min(mixed) >= 16 and max(mixed) <= 64 and len(set(mixed)) > 10, mixed
    assert serve.prompt_lengths(64, True, 5, torch.Generator().manual_seed(0)) == [64] * 5
    assert serve.prompt_lengths(1, False, 3, torch.Generator().manual_seed(0)) == [1] * 3


def test_bench_serve_quotes_a_server_that_did_not_start(tmp_path):
    """A server that exits before it listens is reported with its own last words, not a bare
    connection error."""
    from customops.bench import serve

    with pytest.raises(RuntimeError, match=r"customops-run serve did not start: customops-run: tokenizer not found"):
        serve._Server(str(tmp_path / "missing.pt2"), str(tmp_path / "tokenizer.json"), 1)


def test_bench_serve_report_counts_where_greedy_texts_part(capsys):
    """Beside llama-server the report says how many leading characters the two greedy texts share
    (a random model's choices are close calls that numerics can tip), not only whether all do."""
    from customops.bench import serve

    stats = {"tokens_per_s": 100.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0,
             "max_gap_ms": 1.0}
    row = {"concurrency": 1, "floor_tokens_per_s": 1000.0, "prefill_alone_ms": 1.0, "serve": stats,
           "generate": {**stats, "decode_ms": 1.0}, "llama_server": stats, "same_greedy_text": False,
           "greedy_common_chars": [7, 20, 19]}
    meta = {"device": "cpu", "versions": {}, "layers": 1, "prompt_len": 8, "new_tokens": 3, "requests": 1,
            "variants": []}
    serve.print_report({"meta": meta, "rows": [row], "notes": []})
    assert "7 of 20/19" in capsys.readouterr().out
