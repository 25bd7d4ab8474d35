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


def test_model_bench_rounds_take_medians(tmp_path, capsys):
    """--rounds R builds and times every variant once a round, in turn: each row's times are the
    medians of its R rounds, which the JSON keeps."""
    assert bench_model.main(TINY + ["--variants", "eager,customops.optimize", "--iters", "1", "--rounds", "3",
                                    "--json", str(tmp_path / "r.json")]) == 0
    assert "medians of 3 rounds" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["meta"]["rounds"] == 3
    for r in report["rows"]:
        assert len(r["rounds"]) == 3
        assert r["step_ms"] == sorted(x["step_ms"] for x in r["rounds"])[1]
        assert r["infer_ms"] == sorted(x["infer_ms"] for x in r["rounds"])[1]


def test_model_bench_skips_what_is_missing(monkeypatch, capsys):
    monkeypatch.delattr(customops, "optimize")
    assert bench_model.main(TINY + ["--variants", "eager,customops.optimize", "--iters", "1", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("customops.optimize: not measured (this customops has no optimize)") == 1, out


def test_model_bench_rejects_unknown_variants():
    with pytest.raises(SystemExit, match="unknown variant"):
        bench_model.main(TINY + ["--variants", "eager,nope"])
