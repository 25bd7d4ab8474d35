"""Generation without Python, given what it cannot use: a damaged package, logits that are not
finite, metadata that is not a number, hostile prompt files and options at their edges, a device
the package is not for, a model package_causal_lm cannot package. ``customops-run generate`` ends
each in one line and exit 1 or 2; the C++ API (customops::CausalLM, through generate_api) throws
the exception its header names; neither ever gives ids for them."""

from __future__ import annotations

import zipfile

import pytest
import torch

import customops

transformers = pytest.importorskip("transformers")

import causal_lms as lms  # noqa: E402
from causal_lms import MAX_BATCH, MAX_SEQ_LEN, VOCAB, api, api_error, generate, one_line_error  # noqa: E402
from conftest import DEVICES  # noqa: E402
from test_aoti import run  # noqa: E402

POISONED_ID = 7  # its embedding is NaN in the poisoned package


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A package whose model looks up NaN for POISONED_ID: a sequence holding it gets NaN logits."""
    model = lms.llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[POISONED_ID] = float("nan")
    return customops.export.package_causal_lm(model, tmp_path_factory.mktemp("nan") / "nan.pt2", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ_LEN)


def _rewrite(path, out, edit):
    """path's zip archive written to out with edit(name, data) for each member's data (valid CRCs)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, edit(info.filename, src.read(info)))
    return out


def _flip_byte(path, out, member_suffix):
    """path with one byte in the middle of a member's data flipped, its recorded CRC left as it was."""
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        (info,) = [i for i in z.infolist() if i.filename.endswith(member_suffix)]
    header = info.header_offset
    name_len, extra_len = int.from_bytes(data[header + 26:header + 28], "little"), \
        int.from_bytes(data[header + 28:header + 30], "little")
    data[header + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    out.write_bytes(bytes(data))
    return out


def test_a_damaged_package_is_refused_by_the_runner_and_the_api(packaged, consumer, tmp_path):
    """Flipped bytes in the model library (the weights live there) or the metadata, and a
    truncated file: one line from the runner, std::invalid_argument from the API, before torch's
    loader (which checks no CRC) runs anything."""
    _, path = packaged
    whole = open(path, "rb").read()
    damaged = [_flip_byte(path, tmp_path / "weights.pt2", ".wrapper.so"),
               _flip_byte(path, tmp_path / "metadata.pt2", ".wrapper_metadata.json")]
    (tmp_path / "truncated.pt2").write_bytes(whole[:len(whole) * 2 // 3])
    damaged.append(tmp_path / "truncated.pt2")
    for bad in damaged:
        one_line_error(generate(bad, "--prompt", "5 6 7"), r"damaged|no zip directory")
        api_error(api(consumer, bad, "--prompt", "5 6 7"), "invalid_argument", r"damaged|no zip directory")
    api_error(api(consumer, tmp_path / "missing.pt2", "--prompt", "5"), "invalid_argument", "package not found")


def test_logits_that_are_not_finite_end_the_call_instead_of_giving_ids(poisoned, consumer):
    """Greedy argmax of a NaN row would be id 0 as if it were a token, and sampling would feed NaN
    to multinomial: both end the call naming the prompt; the other prompts alone still generate."""
    good, bad = [5, 6, 8], [5, POISONED_ID, 8]
    for options in ([], ["--temperature", "1.5", "--top-k", "20", "--top-p", "0.9"]):
        args = lms.prompt_args([good, bad]) + ["--max-new-tokens", "4", *options]
        one_line_error(generate(poisoned, *args), r"logits for prompt 1 are not finite \(NaN or inf\) at its new id 1")
        api_error(api(consumer, poisoned, *args), "runtime_error", "logits for prompt 1 are not finite")
    r = generate(poisoned, "--prompt", " ".join(map(str, good)), "--max-new-tokens", "4", "--ignore-eos")
    assert r.returncode == 0 and len(r.stdout.split()) == 4, r.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_a_generated_id_whose_logits_are_not_finite_ends_the_call(device, consumer, tmp_path):
    """The model's greedy ids reach an id whose embedding is NaN: the step after it has NaN logits.
    On CUDA that step is replayed from the graph with the next one already queued behind it, fed
    the NaN step's ids before the host reads them (the -1 that marks them must not reach the
    embedding): the call ends with the error, the device still usable."""
    model = lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    if device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    prompt = lms.prompts(6, seed=4)[0]
    free = lms.hf_generate(model, prompt, 8)
    at = next(j for j in range(2, 8) if free[j] not in free[:j] + prompt)  # first reached there
    with torch.no_grad():
        model.model.embed_tokens.weight[free[at]] = float("nan")
    path = customops.export.package_causal_lm(model, tmp_path / "nan.pt2", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ_LEN)
    args = ["--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "8"]
    error = rf"logits for prompt 0 are not finite \(NaN or inf\) at its new id {at + 2}"
    one_line_error(generate(path, *args), error)
    api_error(api(consumer, path, *args), "runtime_error", error)
    r = generate(path, *args[:2], "--max-new-tokens", str(at + 1))  # ends at the id: never reads its logits
    assert r.returncode == 0 and lms.ids_of(r.stdout) == [free[:at + 1]], r.stderr


def test_metadata_that_is_not_a_number_or_an_older_format_is_named(packaged, consumer, tmp_path):
    _, path = packaged

    def metadata(field, value):
        def edit(name, data):
            if name.endswith("_metadata.json"):
                return data.replace(f'"{field}": "'.encode() + data.split(f'"{field}": "'.encode())[1].split(b'"')[0],
                                    f'"{field}": "{value}'.encode())
            return data
        return _rewrite(path, tmp_path / f"{field}-{value}.pt2", edit)

    for field, value, error in [("max_batch", "two", "metadata field max_batch is not an integer"),
                                ("eos_token_id", "2,x", "metadata field eos_token_id is not an integer or a list"),
                                ("vocab_size", "0", "gives vocab_size 0, less than 1"),
                                ("customops_causal_lm", "1", "written by an older customops; write it again")]:
        bad = metadata(field, value)
        one_line_error(generate(bad, "--prompt", "5"), error)
        api_error(api(consumer, bad, "--prompt", "5"), "invalid_argument", error)


def test_a_prompts_file_is_quoted_and_cut_in_errors(packaged, tmp_path):
    """What the runner echoes from a prompts file cannot garble the terminal or flood it: control
    bytes and bytes that are not UTF-8 as \\xNN, a long word cut; an empty file says so."""
    _, path = packaged
    for name, content, echoed in [("nul", b"5 6\x007\n", r"'6\\x007'"),
                                  ("latin1", b"5 caf\xe9\n", r"'caf\\xe9'"),
                                  ("escape", b"5 \x1b[31mred\n", r"'\\x1b\[31mred'"),
                                  ("long", b"5 " + b"x" * 10_000_000 + b"\n", r"'x{40}'\.\.\. \(10000000 bytes\)")]:
        (tmp_path / name).write_bytes(content)
        line = one_line_error(generate(path, "--prompts", tmp_path / name), rf"line 1: {echoed} is not a token id")
        assert len(line) < 300
    (tmp_path / "empty").write_bytes(b"")
    one_line_error(generate(path, "--prompts", tmp_path / "empty"), r"the prompts file .*empty holds no prompts")


def test_numeric_options_at_their_edges(packaged, consumer):
    """A temperature too small to divide by is as good as greedy (the row's max is taken out first);
    the seed takes every uint64 and nothing else; what no option can mean is named, by the runner
    and by the API alike."""
    model, path = packaged
    prompt = lms.prompts(5)[0]
    want = lms.hf_generate(model, prompt, 6)
    base = ["--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "6"]
    for args in (["--temperature", "1e-40"], ["--temperature", "5e-324", "--top-k", "1000"],
                 ["--seed", str(2**64 - 1), "--temperature", "1e-300", "--top-p", "1e-300"]):
        r = generate(path, *base, *args)
        assert r.returncode == 0 and lms.ids_of(r.stdout) == [want], (args, r.stderr)
        r = api(consumer, path, *base, *args)
        assert r.returncode == 0 and lms.ids_of(r.stdout) == [want], (args, r.stdout)
    for args, error in [(["--seed", "-1"], r"--seed expects an integer in \[0, 18446744073709551615\], got '-1'"),
                        (["--seed", str(2**64)], "--seed expects an integer in"),
                        (["--temperature", "inf"], "temperature must be a finite number >= 0"),
                        (["--temperature", "nan"], "temperature must be a finite number >= 0"),
                        (["--temperature", "-1e-300"], "temperature must be a finite number >= 0"),
                        (["--top-p", "nan"], r"top_p must be in \(0, 1\]"),
                        (["--top-k", "-1"], "top_k must be >= 0"),
                        (["--max-new-tokens", "-5"], "max_new_tokens must be at least 1")]:
        one_line_error(generate(path, *base, *args), error)
        if not args[0] == "--seed":  # (generate_api reads the seed as strtoull does)
            api_error(api(consumer, path, *base, *args), "invalid_argument", error)


def test_a_device_the_package_is_not_for_is_named_alike_however_it_is_spelled(packaged, consumer):
    _, path = packaged
    for device, error in [("cpu:1", "there is one cpu device"), ("cuda", "compiled for cpu and cannot run on cuda"),
                          ("cuda:0", "compiled for cpu and cannot run on cuda:0"), ("tpu", "--device expects")]:
        one_line_error(generate(path, "--prompt", "5", "--device", device), error)
    for device, error in [("cpu:1", "there is one cpu device"), ("cuda:0", "compiled for cpu and cannot run on cuda:0")]:
        api_error(api(consumer, path, "--prompt", "5", "--device", device), "invalid_argument", error)
    r = generate(path, "--prompt", "5", "--device", "cpu:0", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr


def test_a_package_without_a_tokenizer_says_so(packaged):
    """generate --text and serve without --tokenizer take the tokenizer the package embeds; this
    one embeds none."""
    _, path = packaged
    one_line_error(generate(path, "--text", "--prompt", "hello"), "embeds no tokenizer")
    one_line_error(generate(path, "--text", "--tokenizer", "x.json", "--prompt", "hello"),
                   "give --text .* or --tokenizer, not both")
    if "serve" in run([customops.runner_path(), "--version"]).stdout:
        one_line_error(run([customops.runner_path(), "serve", path]), "serve needs --tokenizer .* or a package that embeds")


def test_package_causal_lm_refuses_what_is_not_a_tokenizer(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "vocab.txt").write_text("a\n")
    for bad, error in [(tmp_path / "empty", "holds neither a tokenizer.json nor a tokenizer.model"),
                       (tmp_path / "vocab.txt", "is not a tokenizer.json, a tokenizer.model or a folder"),
                       (3, "must be a path or a transformers tokenizer, got a int"),
                       (lms.llama(), "is a model \\(LlamaForCausalLM\\), not a tokenizer")]:
        with pytest.raises(ValueError, match=f"package_causal_lm: tokenizer.*{error}"):
            customops.export.package_causal_lm(lms.llama(), tmp_path / "x.pt2", tokenizer=bad)


def test_an_error_inside_the_model_is_one_line_without_torch_s_backtrace(packaged, tmp_path):
    """The plain runner given ids outside the vocabulary: the model's embedding raises (and prints
    the error with its C++ backtrace on stderr); the runner's stderr holds one line."""
    _, path = packaged
    customops.export.save_inputs((torch.tensor([[5, VOCAB + 44]]), torch.zeros(1, dtype=torch.long),
                                  torch.full((1,), 2), torch.zeros(1, dtype=torch.long)), tmp_path / "in.pt")
    r = run([customops.runner_path(), path, tmp_path / "in.pt", tmp_path / "out.pt"])
    one_line_error(r, "index out of bounds")
    assert "frame #" not in r.stderr and "Exception raised from" not in r.stderr


@pytest.mark.parametrize("case", ["meta device", "max_batch 2.5", "max_batch True", "max_seq_len 1", "no LM head"])
def test_package_causal_lm_says_why_it_cannot_package_a_model(case, tmp_path):
    model, kwargs = lms.llama(), dict(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    if case == "meta device":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(model.config)
        error = "the model's weights are on the meta device"
    elif case == "no LM head":
        model, error = model.model, "LlamaModel has no LM head"
    else:
        name, value = case.split()
        kwargs[name] = eval(value)
        error = rf"{name} must be an integer >= \d, got {value}"
    with pytest.raises(ValueError, match=rf"package_causal_lm: {error}"):
        customops.export.package_causal_lm(model, tmp_path / "x.pt2", **kwargs)


def test_a_sliding_window_no_layer_uses_is_no_reason_to_refuse():
    """Qwen2 slides only in the layers at or past max_window_layers: with none there, nothing slides
    and any max_seq_len packages; a layer that slides still limits it to the window."""
    from customops.causal_lm import CachedCausalLM

    def qwen2(max_window_layers):
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                       use_sliding_window=True, sliding_window=8, max_window_layers=max_window_layers)
        return transformers.Qwen2ForCausalLM(cfg).eval()

    CachedCausalLM(qwen2(max_window_layers=2), max_seq_len=64)
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        CachedCausalLM(qwen2(max_window_layers=1), max_seq_len=64)
