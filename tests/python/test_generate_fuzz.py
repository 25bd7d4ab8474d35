"""Property-based fuzzing of generation without Python (hypothesis).

- **The runner and the C++ API**: prompts (as options, or a prompts file of drawn bytes: NUL,
  bytes that are not UTF-8, separators, long lines), every numeric option at its edges (0,
  negative, nan, inf, tiny, huge, past 64 bits, not a number) and packages that are good, damaged
  (truncated, a byte flipped in any member) or whose model gives NaN logits for one id. Every case
  ends in ids (in the vocabulary, one line a prompt; from the damaged package only the good one's
  ids; the NaN id at most as a line's last), or: the runner in one line on stderr and exit 1 or 2,
  the API in an exception its header names. Never a signal, a backtrace, or ids from logits that
  are not finite.
- **Export configs**: Hugging Face configs drawn over the supported families' options (rope types
  and scalings, biases, head dims, tied embeddings, eos/pad/bos variants in the config and in
  generation_config, sliding windows, activations, max_seq_len down to 2): each either packages
  and gives, for a batch of unequal prompts, every prompt's Hugging Face float32 greedy ids alone,
  or is refused at export with one sentence that says why.

CI runs a bounded number of examples with a fixed seed. More:
    CUSTOMOPS_GENERATE_FUZZ_EXAMPLES=500 CUSTOMOPS_EXPORT_FUZZ_EXAMPLES=40 CUSTOMOPS_FUZZ_SEED=random \\
        python -m pytest tests/python/test_generate_fuzz.py
"""

from __future__ import annotations

import os
import re
import warnings
import zipfile

import pytest
import torch

import customops

hypothesis = pytest.importorskip("hypothesis")
transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import causal_lms as lms  # noqa: E402
from causal_lms import MAX_BATCH, MAX_SEQ_LEN, VOCAB  # noqa: E402

EXAMPLES = int(os.environ.get("CUSTOMOPS_GENERATE_FUZZ_EXAMPLES", "40"))
CONFIG_EXAMPLES = int(os.environ.get("CUSTOMOPS_EXPORT_FUZZ_EXAMPLES", "2"))  # each packages a model: ~10 s
RANDOM = os.environ.get("CUSTOMOPS_FUZZ_SEED", "") == "random"


def _settings(n):
    return settings(max_examples=n, deadline=None, derandomize=not RANDOM, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


POISONED_ID = 7
# Values an option might be given: the edges of every numeric option, and what is not a number.
EDGES = ["0", "1", "-1", "2", "3", "0.5", "1.5", "nan", "-nan", "inf", "-inf", "1e-40", "5e-324", "-1e-300", "1e308",
         "1e999", "9223372036854775807", "9223372036854775808", "18446744073709551615", "18446744073709551616",
         "-9223372036854775809", "abc", "", " 1", "1 ", "0x10", "1e3", "2.0", "+3"]
OPTIONS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"]
FLAGS = ["--ignore-eos", "--no-cuda-graph"]


@pytest.fixture(scope="module")
def packages(packaged, tmp_path_factory):
    """{"good": the session's package, "poisoned": the same model with POISONED_ID's embedding NaN}."""
    model = lms.llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[POISONED_ID] = float("nan")
    poisoned = customops.export.package_causal_lm(model, tmp_path_factory.mktemp("fuzz") / "nan.pt2",
                                                  max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    return {"good": packaged[1], "poisoned": poisoned}


@st.composite
def damage(draw):
    """None, or how to damage a package: ("truncate", fraction) or ("flip", member index, fraction, bit)."""
    kind = draw(st.sampled_from([None, None, "truncate", "flip"]))
    if kind == "truncate":
        return ("truncate", draw(st.floats(0, 0.999)))
    if kind == "flip":
        return ("flip", draw(st.integers(0, 63)), draw(st.floats(0, 0.999)), draw(st.integers(0, 7)))
    return None


def _damaged(path, how, out):
    data = bytearray(open(path, "rb").read())
    if how[0] == "truncate":
        data = data[:int(len(data) * how[1])]
    else:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
        info = infos[how[1] % len(infos)]
        start = info.header_offset
        end = start + 30 + len(info.filename.encode()) + len(info.extra) + info.compress_size  # header and data
        data[start + int((end - start) * how[2])] ^= 1 << how[3]
    out.write_bytes(bytes(data))
    return out


@st.composite
def prompt_lines(draw):
    """Prompts as the user might write them: ids in and out of the vocabulary, empty and long ones."""
    n = draw(st.integers(0, 3))
    ids = st.integers(-3, VOCAB + 3) | st.sampled_from([POISONED_ID, 5, 6, 200])
    return [" ".join(map(str, draw(st.lists(ids, min_size=0, max_size=MAX_SEQ_LEN + 2)))) for _ in range(n)]


@st.composite
def prompts_file(draw):
    """A prompts file's bytes: id lines, separators, NUL and bytes that are not UTF-8, long lines."""
    parts = draw(st.lists(st.one_of(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(lambda ids: " ".join(map(str, ids)).encode()),
        st.sampled_from([b"\n", b"\r\n", b"\t", b"  ", b"\x00", b"\xff\xfe", b"\xe9", b"-", b"5 x", b"\x1b[2J"]),
        st.integers(1, 200_000).map(lambda n: b"9" * n),
        st.binary(max_size=20)), max_size=8))
    return b"".join(parts)


@st.composite
def options(draw):
    out = []
    for name in draw(st.lists(st.sampled_from(OPTIONS), max_size=4, unique=True)):
        out += [name, draw(st.sampled_from(EDGES) | st.integers(0, 40).map(str))]
    return out + draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))


def _check_ids(stdout, n_prompts, package):
    lines = stdout.splitlines()
    assert len(lines) == n_prompts, stdout
    for line in lines:
        ids = list(map(int, line.split()))
        assert ids and all(0 <= i < VOCAB for i in ids), line
        if package == "poisoned":  # the step after the NaN id's is NaN: it can only end a line
            assert POISONED_ID not in ids[:-1], line


@_settings(EXAMPLES)
@given(driver=st.sampled_from(["runner", "api"]), package=st.sampled_from(["good", "poisoned"]), how=damage(),
       prompts=prompt_lines(), file=st.none() | prompts_file(), opts=options())
def test_every_case_ends_in_ids_or_one_documented_error(packages, consumer, tmp_path_factory, driver, package, how,
                                                        prompts, file, opts):
    tmp = tmp_path_factory.mktemp("case")
    path = packages[package] if how is None else _damaged(packages[package], how, tmp / "damaged.pt2")
    note(f"package {package}, damage {how}")
    args = [a for p in prompts for a in ("--prompt", p)] + opts
    if file is not None and driver == "runner":
        (tmp / "prompts.txt").write_bytes(file)
        args += ["--prompts", str(tmp / "prompts.txt")]
    r = lms.generate(path, *args) if driver == "runner" else lms.api(consumer, path, *args)
    note(f"{driver} {args}: exit {r.returncode}\nstdout {r.stdout[:2000]!r}\nstderr {r.stderr[:2000]!r}")
    assert r.returncode >= 0, f"killed by signal {-r.returncode}"
    if r.returncode == 0:
        n = len(prompts) if file is None or driver == "api" else None
        if n is None:  # the file's prompts: as many as its lines
            n = len(file.split(b"\n")) - (1 if file.endswith(b"\n") else 0)
        _check_ids(r.stdout, n, package)
        if how is not None:  # a package damaged where nothing reads it: the good one's ids, or it was refused
            good = lms.generate(packages[package], *args) if driver == "runner" else lms.api(consumer, packages[package], *args)
            assert good.returncode == 0 and good.stdout == r.stdout
        return
    if driver == "runner":
        assert r.returncode in (1, 2), r.returncode
        lms.one_line_error(r)
        assert "frame #" not in r.stderr and "Exception raised from" not in r.stderr
        assert len(r.stderr) < 1000 and not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", r.stderr), r.stderr
    else:
        assert r.returncode == 3 or (r.returncode == 2 and "expects a value" in r.stderr), r.returncode
        if r.returncode == 3:
            kind = r.stdout.split(":", 1)[0]
            assert kind in ("invalid_argument", "runtime_error", "c10::Error") and len(r.stdout.splitlines()) == 1


# ---- export configs ------------------------------------------------------------------------------

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


@st.composite
def ropes(draw, rotary_dim):
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    p = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 500000.0]))}
    if kind in ("linear", "dynamic"):
        p["factor"] = draw(st.sampled_from([2.0, 4.0]))
    elif kind == "yarn":
        p.update(factor=4.0, original_max_position_embeddings=8)
    elif kind == "llama3":
        p.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
    elif kind == "longrope":
        p.update(short_factor=[1.0 + i / rotary_dim for i in range(rotary_dim // 2)],
                 long_factor=[2.0 + i for i in range(rotary_dim // 2)], original_max_position_embeddings=6)
    return p


@st.composite
def special_ids(draw, kind):
    """An id as a config may give it: none, one, -1, past the vocabulary, or (eos) a list of them."""
    lists = [[2, 9], [9, 2, VOCAB + 3], [11]] if kind == "eos" else []
    return draw(st.sampled_from([None, 1, 2, 0, -1, VOCAB + 44, *lists]))


@st.composite
def configs(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    cfg = dict(hidden_size=heads * head_dim, intermediate_size=draw(st.sampled_from([32, 96])),
               num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=draw(st.integers(1, 2)),
               vocab_size=VOCAB, max_position_embeddings=draw(st.sampled_from([8, 64])),
               tie_word_embeddings=draw(st.booleans()), rope_parameters=draw(ropes(head_dim)),
               hidden_act=draw(st.sampled_from(["silu", "silu", "silu", "gelu"])))
    if family in ("mistral", "qwen3"):
        cfg["head_dim"] = head_dim
    if family == "llama":
        cfg.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    if family == "mistral":
        cfg["sliding_window"] = draw(st.sampled_from([None, 4, 4096]))
    if family in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=draw(st.booleans()), sliding_window=draw(st.sampled_from([4, 4096])),
                   max_window_layers=draw(st.integers(0, 2)))
    if cfg["rope_parameters"]["rope_type"] == "longrope":
        cfg["max_position_embeddings"] = 64
    tokens = {f"{k}_token_id": draw(special_ids(k)) for k in ("bos", "eos", "pad")}
    generation = {f"{k}_token_id": draw(special_ids(k)) for k in ("bos", "eos", "pad")} if draw(st.booleans()) else {}
    max_seq_len = draw(st.sampled_from([2, 3, 16]))
    lengths = draw(st.lists(st.integers(1, max_seq_len), min_size=1, max_size=2))  # prompts of a batch
    return family, cfg, tokens, generation, max_seq_len, lengths


def _expected_refusal(family, cfg, max_seq_len):
    if cfg["hidden_act"] != "silu":
        return "the MLP's activation is 'gelu'"
    window = cfg.get("sliding_window")
    slides = family == "mistral" or (cfg.get("use_sliding_window") and cfg["max_window_layers"] < cfg["num_hidden_layers"])
    if window is not None and slides and max_seq_len > window:
        return f"sliding window of {window} tokens"
    return None


@_settings(CONFIG_EXAMPLES)
@given(case=configs(), seed=st.integers(0, 2**16))
@example(case=("llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=64, hidden_act="silu",
                             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
               {"eos_token_id": [9, 2], "pad_token_id": VOCAB + 44, "bos_token_id": -1}, {}, 2, [2, 1]), seed=0)
@example(case=("qwen2", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, hidden_act="silu",
                             tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                             max_window_layers=2,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                              "long_factor": [4.0 + i for i in range(8)],
                                              "original_max_position_embeddings": 6}),
               {"eos_token_id": 2}, {"eos_token_id": [11, 2]}, 16, [9, 3]), seed=1)
def test_each_config_packages_and_gives_hugging_face_s_greedy_ids_or_is_refused(tmp_path_factory, case, seed):
    family, cfg, tokens, generation, max_seq_len, lengths = case
    max_batch = len(lengths)
    config_cls, model_cls = FAMILIES[family]
    note(f"{family} {cfg} tokens {tokens} generation_config {generation} max_seq_len {max_seq_len} "
         f"max_batch {max_batch}")
    with warnings.catch_warnings():  # Hugging Face's warnings about odd but legal configs: not ours to judge
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**cfg, attn_implementation="sdpa")
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).eval()
    for k, v in tokens.items():
        setattr(model.config, k, v)
    for k, v in {**tokens, **generation}.items():
        setattr(model.generation_config, k, v)
    with torch.no_grad():  # well-separated logits; sharp attention, so that positions matter
        model.lm_head.weight.mul_(20)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    refusal = _expected_refusal(family, cfg, max_seq_len)
    path = tmp_path_factory.mktemp("config") / "lm.pt2"
    try:
        customops.export.package_causal_lm(model, path, max_batch=max_batch, max_seq_len=max_seq_len)
    except ValueError as e:
        message = str(e)
        assert refusal is not None and refusal in message, message
        assert message.startswith("customops.export.package_causal_lm: ") and "\n" not in message
        return
    assert refusal is None, f"packaged a model it should refuse: {refusal}"
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    new = 6
    r = lms.generate(path, *lms.prompt_args(ps), "--max-new-tokens", str(new))
    assert r.returncode == 0, r.stderr
    # a sequence ends when its cache is full: its prompt and its new ids but the last fill it
    want = [lms.hf_generate(model, p, min(new, max_seq_len - len(p) + 1)) for p in ps]
    assert lms.ids_of(r.stdout) == want

