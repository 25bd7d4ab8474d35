"""`python -m customops bench --model llama` end to end on a tiny Llama on CPU (the GPU machine runs
the real shapes): every variant asked for is measured, losses agree, the report renders."""

import json
import math

import pytest

import customops
from customops.bench import model as bench_model

pytest.importorskip("transformers")

TINY = ["--model", "llama", "--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads",
        "4", "--kv-heads", "2", "--vocab", "256", "--batch", "2", "--seq", "16", "--iters", "2", "--warmup", "1",
        "--dtype", "float32", "--no-progress"]


def test_model_bench_runs_and_losses_agree(tmp_path, capsys):
    doc = tmp_path / "b.md"
    doc.write_text("<!-- bench:llama -->\n<!-- /bench:llama -->\n")
    rc = bench_model.main(TINY + ["--variants", "eager,customops.optimize", "--json", str(tmp_path / "r.json"),
                                  "--doc", str(doc)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "eager" in out and "customops.optimize" in out
    assert "| eager |" in doc.read_text() and "| customops.optimize |" in doc.read_text()
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in report["rows"]] == ["eager", "customops.optimize"]
    losses = [r["loss"] for r in report["rows"]]
    assert all(math.isfinite(x) for x in losses) and abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0])
    assert not report["mismatches"] and not report["failures"]
    assert all(t["met"] is None and "not measured" in t["measured"] for t in report["targets"])


def test_model_bench_skips_what_is_missing(monkeypatch, capsys):
    monkeypatch.delattr(customops, "optimize")
    assert bench_model.main(TINY + ["--variants", "eager,customops.optimize", "--iters", "1"]) == 0
    assert "customops.optimize: not measured (this customops has no optimize)" in capsys.readouterr().out


def test_model_bench_rejects_unknown_variants():
    with pytest.raises(SystemExit, match="unknown variant"):
        bench_model.main(TINY + ["--variants", "eager,nope"])
