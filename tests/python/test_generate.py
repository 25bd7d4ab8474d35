"""Generation without Python: a Hugging Face Llama packaged with its KV cache
(customops.export.package_causal_lm) agrees with Hugging Face's eager forward at every position,
and ``customops-run generate`` and the C++ API (customops::CausalLM, through the consumer program
generate_api) give the ids of ``model.generate``; bad input gets one line and a non-zero exit, a
damaged package or logits that are not finite an error, never ids. Small float32 models, each
packaged once (about 10 s here). The packages run with torch's input checks on, in this process
as in the runner."""

from __future__ import annotations

import os
import re
import zipfile

import pytest
import torch

import customops

transformers = pytest.importorskip("transformers")

import causal_lms as lms  # noqa: E402
from causal_lms import MAX_BATCH, MAX_SEQ_LEN, VOCAB  # noqa: E402
from conftest import DEVICES  # noqa: E402
from test_aoti import run  # noqa: E402  (the runner's environment: no Python on its path)

# The packages loaded in this process check their inputs as customops-run's and CausalLM's do (read
# when a package first runs): a decode step's one token must be inside the declared range.
os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"


def _generates_hf_greedy_ids(model, path, prompts, n):
    """customops-run generate of prompts (one batch) against model.generate of each; the run."""
    r = lms.generate(path, *lms.prompt_args(prompts), "--max-new-tokens", str(n))
    assert r.returncode == 0, r.stderr
    assert lms.ids_of(r.stdout) == [lms.hf_generate(model, p, n) for p in prompts]
    return r


def test_teacher_forced_logits_match_hugging_face_at_every_position(packaged):
    model, path = packaged
    lm = torch._inductor.aoti_load_package(path)
    ids = torch.tensor(lms.prompts(MAX_SEQ_LEN, MAX_SEQ_LEN))
    with torch.no_grad():
        want = model(ids).logits
    longs = dict(dtype=torch.long)
    # a prefill of 5 tokens, then one token a call up to a full cache
    got = [lm(ids[:, :5].contiguous(), torch.zeros(2, **longs), torch.full((2,), 5, **longs), torch.arange(2))]
    for t in range(5, MAX_SEQ_LEN):
        got.append(lm(ids[:, t:t + 1].contiguous(), torch.full((2,), t, **longs), torch.ones(2, **longs), torch.arange(2)))
    got = torch.stack(got, 1)
    torch.testing.assert_close(got, want[:, 4:], atol=1e-4, rtol=1e-4)
    # prompts of different lengths in one batch, right-padded: each gives its own last logits
    got = lm(ids[:, :7].contiguous(), torch.zeros(2, **longs), torch.tensor([7, 3]), torch.arange(2))
    torch.testing.assert_close(got, torch.stack([want[0, 6], want[1, 2]]), atol=1e-4, rtol=1e-4)
    # each sequence in the other's slot, interleaved: sequence 0 prefills in slot 1, sequence 1 in
    # slot 0, then each decodes reading its own slot (a package that ignored the slots would read
    # sequence 1's keys for sequence 0)
    one = dict(dtype=torch.long)

    def call(seq, t0, t1, slot):
        return lm(ids[seq:seq + 1, t0:t1].contiguous(), torch.full((1,), t0, **one), torch.full((1,), t1 - t0, **one),
                  torch.full((1,), slot, **one))[0]

    torch.testing.assert_close(call(0, 0, 5, slot=1), want[0, 4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(call(1, 0, 5, slot=0), want[1, 4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(call(0, 5, 6, slot=1), want[0, 5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(call(1, 5, 6, slot=0), want[1, 5], atol=1e-4, rtol=1e-4)


def test_a_failed_call_leaves_nothing_the_next_call_reads(packaged):
    model, path = packaged
    lm = torch._inductor.aoti_load_package(path)
    ids = torch.tensor(lms.prompts(6))
    longs = dict(dtype=torch.long)
    with pytest.raises(Exception):  # too many tokens for the cache: the package's own input check
        lm(torch.zeros(1, MAX_SEQ_LEN + 1, **longs), torch.zeros(1, **longs), torch.ones(1, **longs), torch.zeros(1, **longs))
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    torch.testing.assert_close(lm(ids, torch.zeros(1, **longs), torch.full((1,), 6, **longs), torch.zeros(1, **longs))[0], want,
                               atol=1e-4, rtol=1e-4)


def test_runner_generates_hugging_face_greedy_ids_for_a_batch_of_unequal_prompts(packaged):
    model, path = packaged
    r = _generates_hf_greedy_ids(model, path, lms.prompts(9, 4), 8)
    assert "prefill: 13 tokens" in r.stderr and "ms/token" in r.stderr, r.stderr
    assert "CUDA graph" not in r.stderr  # a CPU package
    # the timed call without the warm-up call before it: the same ids
    args = [a for p in lms.prompts(9, 4) for a in ("--prompt", " ".join(map(str, p)))]
    cold = lms.generate(path, *args, "--max-new-tokens", "8", "--no-warmup")
    assert cold.returncode == 0 and cold.stdout == r.stdout, cold.stderr


def test_runner_fills_the_cache_to_max_seq_len(packaged, tmp_path):
    model, path = packaged
    # a prompt one short of the cache: its first new id is decoded into the last position, and
    # the sequence ends there, however many new ids were asked for
    prompt = lms.prompts(MAX_SEQ_LEN - 1)[0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(map(str, prompt)) + "\n")
    r = lms.generate(path, "--prompts", prompts, "--max-new-tokens", "5", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert list(map(int, r.stdout.split())) == lms.hf_generate(model, prompt, 2)
    full = lms.prompts(MAX_SEQ_LEN)[0]
    r = lms.generate(path, "--prompt", " ".join(map(str, full)), "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert list(map(int, r.stdout.split())) == lms.hf_generate(model, full, 1)


def test_runner_pads_prefill_chunks_to_a_multiple_when_asked(packaged):
    """CUSTOMOPS_PREFILL_MULTIPLE=N rounds a prefill run's chunk up to a multiple of N where the
    caches leave room (padding that no query reads): the same greedy ids (float32 on the CPU:
    exactly), also for a prompt one short of the cache, where N does not fit; a value that is no
    count is refused in one line. (The warm-up of the padded shapes is an engine thread's:
    test_engine.py.)"""
    model, path = packaged

    def generate(multiple, *args):
        return lms.run([customops.runner_path(), "generate", path, *args],
                       env={"CUSTOMOPS_PREFILL_MULTIPLE": multiple})

    args = [*lms.prompt_args(lms.prompts(9, 4)), "--max-new-tokens", "8"]
    plain = generate("", *args)
    assert plain.returncode == 0, plain.stderr
    for multiple in ("16", "4"):
        padded = generate(multiple, *args)
        assert padded.returncode == 0 and padded.stdout == plain.stdout, (multiple, padded.stderr)
    prompt = lms.prompts(MAX_SEQ_LEN - 1)[0]
    r = generate(str(4 * MAX_SEQ_LEN), "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "3", "--ignore-eos")
    assert r.returncode == 0 and list(map(int, r.stdout.split())) == lms.hf_generate(model, prompt, 2), r.stderr
    lms.one_line_error(generate("16x", *args), "CUSTOMOPS_PREFILL_MULTIPLE must be a count of tokens")


@pytest.mark.parametrize("device", DEVICES)
def test_runner_stops_a_sequence_at_any_of_its_eos_ids_while_the_other_goes_on(device, tmp_path):
    """The model's generation_config lists three eos ids, one of which the first prompt's greedy ids
    reach at its third new id: that line ends there and the other prompt's goes on, as
    model.generate gives them (which takes generation_config's ids, not the config's: the config's
    eos is one the second prompt reaches, and must not end it). The pad id is outside the
    vocabulary (padding is written to the cache, never read: any id of the vocabulary pads). On CUDA
    the runner queues each decode step before it reads the step before (a CUDA graph, head dim 64),
    so the ended sequence is fed one more id, which must not show."""
    model = lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    if device == "cuda":
        model = model.to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    for seed in range(2, 20):  # prompts whose first's greedy ids reach an id the other's never do
        prompts = lms.prompts(9, 4, seed=seed)
        free = [lms.hf_generate(model, p, 8) for p in prompts]
        eos = next((i for i in free[0][2:] if i not in free[0][:2] and i not in free[1]), None)
        if eos is not None:
            break
    else:
        pytest.fail(f"no prompts among 18 seeds whose greedy ids end one sequence only: {free}")
    never = [i for i in range(3, VOCAB) if i not in free[0] + free[1]][:2]
    model.generation_config.eos_token_id = [never[0], eos, never[1]]
    model.config.eos_token_id = next(i for i in free[1] if i != eos)
    model.generation_config.pad_token_id = model.config.pad_token_id = VOCAB + 44
    with pytest.warns(UserWarning, match=rf"pad_token_id \[{VOCAB + 44}\] is outside the vocabulary"):
        path = customops.export.package_causal_lm(model, tmp_path / "llama-eos.pt2", max_batch=MAX_BATCH,
                                                  max_seq_len=MAX_SEQ_LEN)
    info = dict(line.split(": ", 1) for line in run([customops.runner_path(), "--info", path]).stdout.splitlines())
    assert info["eos_token_id"] == f"{never[0]},{eos},{never[1]}" and info["pad_token_id"] == "", info
    assert info["weights"] == info["lm_head_weights"] == info["dtype"], info  # unquantized: the model's dtype
    r = _generates_hf_greedy_ids(model, path, prompts, 8)
    first, second = (line.split() for line in r.stdout.splitlines())
    assert first[-1] == str(eos) and len(first) < 8 and len(second) == 8, r.stdout
    assert ("CUDA graph" in r.stderr) == (device == "cuda"), r.stderr
    # a prompt one short of the cache beside a short one: the first ends when the cache is full
    # (which the CUDA loop knows ahead: no step past it), the second goes on
    full = lms.prompts(MAX_SEQ_LEN - 1)[0]
    r = lms.generate(path, "--prompt", " ".join(map(str, full)), "--prompt", " ".join(map(str, prompts[1])),
                  "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert [list(map(int, line.split())) for line in r.stdout.splitlines()] == [
        lms.hf_generate(model, full, 2), lms.hf_generate(model, prompts[1], 4)]


def test_seeded_sampling_is_reproducible(packaged):
    _, path = packaged
    prompt = " ".join(map(str, lms.prompts(5)[0]))
    args = ["--prompt", prompt, "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "3", "--top-k", "50",
            "--top-p", "0.95", "--ignore-eos"]
    a, b, c = (lms.generate(path, *args, "--seed", s) for s in ("7", "7", "8"))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout  # 20 draws at temperature 3 from ~50 ids
    assert all(len(line.split()) == 10 for line in a.stdout.splitlines())


def _definition_draws(model, prompt, n, seed, temperature, top_k, top_p):
    """n ids sampled as the definition says, from Hugging Face's float32 logits of each prefix: the
    logits less their largest, over the temperature; ids below the k-th largest dropped; then, in
    descending order, each id whose predecessors' probability already passes top_p; one draw from
    the rest by inverse transform (a uniform u from a generator seeded with seed, and the first id
    whose cumulative mass, exp of the float32 values summed in float64, passes u times the total).
    Also the kept counts of each step."""
    g = torch.Generator().manual_seed(seed)
    ids, kept = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        lg = (logits - logits.max()) / temperature
        if top_k:
            lg = lg.masked_fill(lg < lg.topk(top_k).values[-1], -torch.inf)
        values, order = lg.sort(descending=True)
        probs = values.softmax(-1)
        lg[order[(probs.cumsum(-1) - probs) > top_p]] = -torch.inf
        kept.append(int(torch.isfinite(lg).sum()))
        u = torch.empty(1, 1, dtype=torch.float64).uniform_(0, 1, generator=g)[0]
        cdf = lg.float().exp().double().cumsum(-1)
        ids.append(int(torch.searchsorted(cdf, u * cdf[-1:], right=True).clamp_max(VOCAB - 1)))
    return ids[len(prompt):], kept


@pytest.mark.parametrize("temperature, top_k, top_p", [(12.0, 40, 0.8), (6.0, 0, 0.5)])
def test_sampled_ids_are_the_definitions_draws(packaged, temperature, top_k, top_p):
    """customops-run generate samples as _definition_draws says, each prompt from its own generator
    (seeded with --seed for prompt 0, and --seed xor 0x9E3779B97F4A7C15 i for prompt i): the same ids.
    The temperatures leave top-p keeping fewer ids than top-k (or the vocabulary) at some steps,
    and more than one."""
    model, path = packaged
    ps = lms.prompts(5, 9, seed=3)
    counts = []
    for seed in (1, 2**63 + 5):
        r = lms.generate(path, *lms.prompt_args(ps), "--max-new-tokens", "4", "--temperature", str(temperature),
                         "--top-k", str(top_k), "--top-p", str(top_p), "--seed", str(seed), "--ignore-eos")
        assert r.returncode == 0, r.stderr
        for i, (p, got) in enumerate(zip(ps, lms.ids_of(r.stdout))):
            want, kept = _definition_draws(model, p, 4, seed ^ (0x9E3779B97F4A7C15 * i) % 2**64, temperature, top_k,
                                           top_p)
            assert got == want, (seed, i)
            counts += kept
    assert any(1 < k < (top_k or VOCAB) for k in counts), counts


@pytest.mark.parametrize("args,error", [
    (["--prompt", " ".join(["5"] * (MAX_SEQ_LEN + 1))], r"prompt 0 has 25 ids, more than the package's max_seq_len \(24\)"),
    (["--prompt", "5", "--prompt", "6", "--prompt", "7"], r"3 prompts, but the package takes 1 to 2"),
    (["--prompt", "5 256"], r"prompt 0 holds id 256 at position 1, outside the vocabulary \[0, 256\)"),
    (["--prompt", "5 x"], r"--prompt 1: 'x' is not a token id"),
    (["--prompt", "5", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--prompt", "5", "--max-new-tokens", "0"], r"max_new_tokens must be at least 1"),
    ([], r"generate expects --prompt"),
])
def test_runner_says_what_is_wrong(packaged, args, error):
    import re

    r = lms.generate(packaged[1], *args)
    assert r.returncode in (1, 2), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(error, lines[0]), r.stderr


def test_runner_rejects_bad_prompt_files_and_packages(packaged, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_text("5 6\n\n7\n")
    r = lms.generate(packaged[1], "--prompts", bad)
    assert r.returncode == 1 and "prompts.txt line 2 holds no ids" in r.stderr, r.stderr
    not_lm = tmp_path / "not.pt2"
    not_lm.write_bytes(b"not a zip file")
    r = lms.generate(not_lm, "--prompt", "5")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _tokenizer(tmp_path):
    """A SentencePiece BPE model with the test model's vocabulary (256 ids; bos 1, eos 2, as
    LlamaConfig's), trained on pseudo-words, a backslash among its pieces; (processor, its file).
    Skips where customops-run was built without SentencePiece."""
    spm = pytest.importorskip("sentencepiece")
    if "SentencePiece" not in run([customops.runner_path(), "--version"]).stdout:
        pytest.skip("customops-run was built without SentencePiece (Debian: libsentencepiece-dev)")
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + rng.choice([".", ",", "\\", "!"]) for _ in range(600)]
    path = tmp_path / "tokenizer.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=f, vocab_size=VOCAB, model_type="bpe",
                                       bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.get_piece_size() == VOCAB
    return sp, path


def test_runner_generates_text_through_a_sentencepiece_tokenizer(packaged, tmp_path):
    """Text in and out (--tokenizer) is the ids path with SentencePiece on both ends: the prompt
    after the package's bos id, the new ids decoded, one line each."""
    sp, model_file = _tokenizer(tmp_path)
    texts = ["the quick brown fox", "jumps over\\ the lazy dog."]
    opts = ["--max-new-tokens", "12", "--ignore-eos"]
    r = lms.generate(packaged[1], "--tokenizer", model_file, *[a for t in texts for a in ("--prompt", t)], *opts)
    assert r.returncode == 0, r.stderr
    ids = lms.generate(packaged[1], *[a for t in texts for a in ("--prompt", " ".join(map(str, [1] + sp.encode(t))))],
                    *opts)
    assert ids.returncode == 0, ids.stderr
    want = [sp.decode(list(map(int, line.split()))).replace("\\", "\\\\").replace("\n", "\\n")
            for line in ids.stdout.splitlines()]
    assert r.stdout.splitlines() == want and len(want) == 2
    # --no-bos: the prompt's own ids only
    nobos = lms.generate(packaged[1], "--tokenizer", model_file, "--prompt", texts[0], "--no-bos", *opts)
    direct = lms.generate(packaged[1], "--prompt", " ".join(map(str, sp.encode(texts[0]))), *opts)
    assert nobos.stdout == sp.decode(list(map(int, direct.stdout.split()))).replace("\\", "\\\\") + "\n"


def test_runner_says_what_is_wrong_with_a_tokenizer(packaged, tmp_path):
    _, model_file = _tokenizer(tmp_path)
    not_a_model = tmp_path / "bad.model"
    not_a_model.write_bytes(b"not a sentencepiece model")
    empty = tmp_path / "prompts.txt"
    empty.write_text("hello\n\n")
    for args, error in [
        (["--tokenizer", tmp_path / "missing.model", "--prompt", "hi"], "tokenizer not found: "),
        (["--tokenizer", not_a_model, "--prompt", "hi"], "bad.model is not a SentencePiece model"),
        (["--tokenizer", model_file, "--prompts", empty], "prompts.txt line 2 is empty"),
        (["--prompt", "5", "--no-bos"], "--no-bos is for text prompts"),
    ]:
        r = lms.generate(packaged[1], *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode in (1, 2) and len(lines) == 1 and error in lines[0], r.stderr


FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),  # biased q, k and v
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=False, head_dim=16)),  # q and k norms
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_cached_module_matches_hugging_face_for_each_family(family):
    """The module the package is exported from (eager, no compile: its math), per family: a prefill,
    then decode steps, against Hugging Face's forward; the package holds the concatenated q/k/v
    and gate/up weights instead of the model's own, never both."""
    config, cls, extra = FAMILY_CONFIGS[family]
    cfg = getattr(transformers, config)(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                         max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():  # biases (zero at init) that the concatenation must keep in their place
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    from customops.causal_lm import CachedCausalLM

    lm = CachedCausalLM(model, max_batch=2, max_seq_len=16)
    assert not [n for n in lm.state_dict() if any(w in n for w in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
    ids = torch.tensor(lms.prompts(10, 10))
    longs = dict(dtype=torch.long)
    with torch.no_grad():
        want = model(ids).logits
        got = [lm(ids[:, :6], torch.zeros(2, **longs), torch.full((2,), 6, **longs))]
        got += [lm(ids[:, t:t + 1], torch.full((2,), t, **longs), torch.ones(2, **longs)) for t in range(6, 10)]
    torch.testing.assert_close(torch.stack(got, 1), want[:, 5:], atol=1e-4, rtol=1e-4)


def _greedy(lm, prompts, n):
    """n greedy new ids a prompt from the cached module (eager), its prompts in one right-padded batch."""
    longs = dict(dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.tensor([p + [0] * (int(lengths.max()) - len(p)) for p in prompts])
    out = []
    with torch.no_grad():
        nxt = lm(ids, torch.zeros(len(prompts), **longs), lengths).argmax(-1)
        for _ in range(n - 1):
            out.append(nxt)
            nxt = lm(nxt[:, None], lengths, torch.ones(len(prompts), **longs)).argmax(-1)
            lengths = lengths + 1
    return torch.stack(out + [nxt], 1).tolist()


@pytest.mark.parametrize("rope", [
    dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
         long_factor=[2.0 + i for i in range(8)], original_max_position_embeddings=8),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
], ids=["longrope", "dynamic"])
def test_a_rope_that_depends_on_the_length_follows_each_sequence_s_own(rope):
    """Hugging Face decides "longrope"'s long factors (past original_max_position_embeddings) and
    "dynamic"'s grown base (past max_position_embeddings) by the largest position of the whole
    batch; the cached module by each sequence's own length. In a batch of a prompt past the
    threshold and one below it that crosses it while decoding, each gets the greedy ids it gets
    alone from Hugging Face (from a fresh rotary state: "dynamic" keeps what it grew to)."""
    from customops.causal_lm import CachedCausalLM

    model = lms.llama(rope_parameters=rope, max_position_embeddings=64 if rope["rope_type"] == "longrope" else 8)
    with torch.no_grad():  # sharp attention, so that the rotation's frequencies decide the ids
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    ps = lms.prompts(12, 4, seed=3)
    want = [lms.hf_generate(model, p, 8) for p in ps]
    assert _greedy(CachedCausalLM(model, max_batch=2, max_seq_len=24), ps, 8) == want


def test_each_product_of_the_exported_graph_is_one_fused_linear():
    """What package_causal_lm exports: a layer's four products and the LM head are
    customops.fused_linear calls carrying the norms, SwiGLU and the residual adds; no other matrix
    product, norm or activation op is left beside them (the adds left are of positions). A layer's
    rotation and cache write are one rope_cache_write."""
    from customops.causal_lm import CachedCausalLM

    lm = CachedCausalLM(lms.llama(), max_batch=1, max_seq_len=16)
    longs = dict(dtype=torch.long)
    with torch.no_grad():
        ep = torch.export.export(lm, (torch.tensor([[5, 6, 7]]), torch.zeros(1, **longs), torch.full((1,), 3, **longs)))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("customops.fused_linear.default") == 4 * 2 + 1, targets
    left = [t for t in targets if any(k in t for k in ("linear.", "mm.", "matmul", "rms_norm", "swiglu"))]
    assert left == ["customops.fused_linear.default"] * 9, left
    assert targets.count("customops.rope_cache_write.default") == 2, targets
    assert not [t for t in targets if t in ("customops.rope.default", "customops.cache_write.default")], targets


def test_the_package_computes_the_rotation_and_the_lengths_once_for_every_layer(packaged):
    """cos, sin and the lengths are buffers that every layer's rope_cache_write and cache_attention
    read, not a copy made for each call (Inductor's default for such cheap nodes). Read from the
    package's wrapper: the extern calls' tensor arguments, rope_cache_write's 10 and
    cache_attention's 7."""
    _, path = packaged
    with zipfile.ZipFile(path) as z:
        [wrapper] = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    calls = re.findall(r"aoti_torch_proxy_executor_call_function\(proxy_executor,[^;]*?"
                       r"std::array<AtenTensorHandle, (\d+)>\{([^;]*)\}\.data\(\)", wrapper)
    layers = len(lms.llama().model.layers)

    def shared(n_args):
        args = [set(re.findall(r"\bbuf\d+\b", a)) for n, a in calls if int(n) == n_args]
        assert len(args) == layers, calls
        return set.intersection(*args)

    assert len(shared(10)) == 2, calls  # cos and sin, besides each layer's q, k, v and caches
    assert len(shared(7)) == 1, calls  # the lengths


def test_package_causal_lm_refuses_an_activation_it_does_not_compute(tmp_path):
    model = lms.llama()
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="package_causal_lm: the MLP's activation is 'gelu'"):
        customops.export.package_causal_lm(model, tmp_path / "x.pt2")


def test_package_metadata_names_the_model(packaged):
    r = run([customops.runner_path(), "--info", packaged[1]])
    assert r.returncode == 0, r.stderr
    meta = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert meta["customops_causal_lm"] == "3" and meta["family"] == "llama"
    assert (meta["max_batch"], meta["max_seq_len"], meta["vocab_size"]) == ("2", "24", "256")
    assert meta["eos_token_id"] == "2" and meta["customops_version"] == customops.__version__


def test_package_points_a_causal_lm_at_package_causal_lm(tmp_path):
    with pytest.raises(TypeError, match="package_causal_lm"):
        customops.export.package(lms.llama(), (torch.zeros(1, 4, dtype=torch.long),), tmp_path / "x.pt2")


@pytest.mark.skipif(not torch.cuda.is_available() or not customops.build_info()["cuda"], reason="needs CUDA")
def test_cuda_bfloat16_package_generates_hugging_face_greedy_ids(tmp_path):
    # head dim 64, which cache_attention's kernel takes: the runner replays decode from a CUDA graph
    model = lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to("cuda", torch.bfloat16)
    path = customops.export.package_causal_lm(model, tmp_path / "llama-cuda.pt2", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ_LEN)
    lm = torch._inductor.aoti_load_package(path)
    ids = torch.tensor(lms.prompts(12, 12), device="cuda")
    longs = dict(dtype=torch.long, device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
    got = lm(ids[:, :8].contiguous(), torch.zeros(2, **longs), torch.full((2,), 8, **longs), torch.arange(2, **longs))
    torch.testing.assert_close(got, want[:, 7], atol=0.5, rtol=5e-2)  # bf16 through 2 layers and a x20 head
    r = _generates_hf_greedy_ids(model, path, lms.prompts(9, 4), 8)
    assert "CUDA graph" in r.stderr, r.stderr  # decode steps replayed from the graph
    args = [a for p in lms.prompts(9, 4) for a in ("--prompt", " ".join(map(str, p)))]
    launched = lms.generate(path, *args, "--max-new-tokens", "8", "--no-cuda-graph")
    assert launched.returncode == 0 and launched.stdout == r.stdout, launched.stderr
    assert "CUDA graph" not in launched.stderr


@pytest.mark.skipif(not torch.cuda.is_available() or not customops.build_info()["cuda"], reason="needs CUDA")
@pytest.mark.parametrize("vocab", [lms.VOCAB, lms.VOCAB + 3], ids=["vectors", "odd"])
def test_cuda_greedy_ids_take_the_first_of_equal_logits(tmp_path, vocab):
    """CUDA's greedy kernel (cuda/greedy.cu) keeps at::max's rule: an LM head whose second half
    repeats its first gives every largest logit twice, and the first id wins, every step; the first
    new id of each prompt is ATen's argmax of the package's own logits. A vocabulary of whole 16-byte
    vectors of logits and one that is not (the kernel's two loops); CUSTOMOPS_GREEDY_KERNEL=0 (ATen's
    max instead) gives the same ids. (Not against Hugging Face's ids: in bfloat16 such a small
    model's choices are close calls.)"""
    model = lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab)
    half = vocab // 2
    with torch.no_grad():
        model.lm_head.weight[half:2 * half] = model.lm_head.weight[:half]
    model = model.to("cuda", torch.bfloat16)
    path = customops.export.package_causal_lm(model, tmp_path / "twice.pt2", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ_LEN)
    prompts = [[3 + i % (half - 3) for i in p] for p in lms.prompts(9, 4)]
    r = lms.generate(path, *lms.prompt_args(prompts), "--max-new-tokens", "8", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    got = lms.ids_of(r.stdout)
    assert all(len(ids) == 8 and all(i < half or i == 2 * half for i in ids) for ids in got), got
    lm = torch._inductor.aoti_load_package(path)
    longs = dict(dtype=torch.long, device="cuda")
    ids = torch.tensor([p + [0] * (9 - len(p)) for p in prompts], device="cuda")
    logits = lm(ids, torch.zeros(2, **longs), torch.tensor([len(p) for p in prompts], **longs), torch.arange(2, **longs))
    assert logits.argmax(-1).tolist() == [ids[0] for ids in got]
    aten = lms.run([customops.runner_path(), "generate", path, *lms.prompt_args(prompts), "--max-new-tokens", "8",
                    "--ignore-eos"], env={"CUSTOMOPS_GREEDY_KERNEL": "0"})  # ATen's max, the switch's way
    assert aten.returncode == 0 and aten.stdout == r.stdout, aten.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_attention_never_reads_past_a_length(device, dtype):
    # NaN past each sequence's length (and in the cache's extra sequence) must not reach the output;
    # bfloat16 on CUDA runs the split-KV kernel, with several splits for the 700-long sequence
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=g).to(device, dtype)
    k_cache, v_cache = (torch.randn(3, 2, 1024, 64, generator=g).to(device, dtype) for _ in range(2))
    lengths = torch.tensor([5, 700], device=device)
    for c in (k_cache, v_cache):
        c[0, :, 5:] = float("nan")
        c[1, :, 700:] = float("nan")
        c[2] = float("nan")
    out, lse = customops.cache_attention(q, k_cache, v_cache, lengths)
    for b, n in enumerate(lengths.tolist()):
        o, l = customops.attention(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n], causal=True,
                                   return_lse=True)
        torch.testing.assert_close(out[b:b + 1], o, atol=2e-2, rtol=1.6e-2)
        torch.testing.assert_close(lse[b:b + 1], l, atol=2e-2, rtol=1.6e-2)
    with pytest.raises(RuntimeError, match="customops::cache_attention is not differentiable"):
        customops.cache_attention(q.float().requires_grad_(), k_cache.float(), v_cache.float(), lengths)


@pytest.mark.skipif(not any(d == "cuda" for d in DEVICES), reason="the CUDA kernel's behaviour")
def test_cache_attention_cuda_gives_nan_rows_for_a_length_out_of_range():
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = customops.cache_attention(q, kc, kc, torch.tensor([17, 16], device="cuda"))  # no host sync: NaN
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert out[1].isfinite().all() and lse[1].isfinite().all()


def _matches_attention_on_each_length(q, k_cache, v_cache, out, lse, lengths, slots):
    """cache_attention's out and lse for row i against attention (float32) over the cache's slot
    slots[i] up to lengths[i]; NaN rows for a length past the cache."""
    for i, (n, c) in enumerate(zip(lengths, slots)):
        if n > k_cache.size(2):
            assert out[i].isnan().all() and lse[i].isnan().all()
            continue
        o, l = customops.attention(q[i:i + 1].float(), k_cache[c:c + 1, :, :n].float(), v_cache[c:c + 1, :, :n].float(),
                                   causal=True, return_lse=True)
        torch.testing.assert_close(out[i:i + 1].float(), o, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[i:i + 1], l, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not any(d == "cuda" for d in DEVICES), reason="the CUDA kernel's paths")
@pytest.mark.parametrize(
    "cluster,warps", [("", ""), ("16", ""), ("0", ""), ("", "4"), ("0", "4"), ("", "8"), ("0", "8")],
    ids=["clusters", "clusters-of-16", "merge-kernel", "4-warps", "4-warps-merge-kernel", "8-warps", "8-warps-merge-kernel"])
@pytest.mark.parametrize("d,t,dtype", [(128, 1, torch.bfloat16), (64, 4, torch.float16), (256, 3, torch.bfloat16)])
def test_cache_attention_cuda_merges_its_splits(monkeypatch, cluster, warps, d, t, dtype):
    # Long caches at batches 1 and 3 give several splits a sequence, merged in a thread-block cluster on
    # sm_90 (at most 8 blocks, or 16; where the GPU cannot seat them all, as 8-warp blocks at head dim
    # 128 and batch 3, by the merge kernel) or by the merge kernel (CUSTOMOPS_CACHE_ATTENTION_CLUSTER=0, as
    # before sm_90); lengths that leave some splits without keys, and one out of range (NaN rows), alone
    # and in one batch. Blocks of 4 or 8 warps as chosen, or either (CUSTOMOPS_CACHE_ATTENTION_WARPS; 8
    # where the GPU takes them: head dims 64 and 128); the chosen count is 8 for batch 1 with 16k
    # positions (2048 a split), 4 for the 4096-position caches.
    for name, value in (("CUSTOMOPS_CACHE_ATTENTION_CLUSTER", cluster), ("CUSTOMOPS_CACHE_ATTENTION_WARPS", warps)):
        if value:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    g = torch.Generator().manual_seed(d + t)
    cases = [(4096, [4096]), (4096, [3000, 70, 4097]), (4096, [70]), (4096, [4097])]
    if d == 128:
        cases.append((16384, [12000]))
    for size, lengths in cases:
        b = len(lengths)
        q = torch.randn(b, 32, t, d, generator=g).to("cuda", dtype)
        k_cache, v_cache = (torch.randn(b, 8, size, d, generator=g).to("cuda", dtype) for _ in range(2))
        out, lse = customops.cache_attention(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"))
        _matches_attention_on_each_length(q, k_cache, v_cache, out, lse, lengths, range(b))


@pytest.mark.skipif(not any(d == "cuda" for d in DEVICES), reason="the CUDA kernel's paths")
@pytest.mark.parametrize("cluster", ["", "0"], ids=["clusters", "merge-kernel"])
@pytest.mark.parametrize("d,t,dtype", [(64, 17, torch.float16), (128, 32, torch.bfloat16), (128, 64, torch.bfloat16),
                                       (128, 128, torch.bfloat16), (256, 32, torch.bfloat16), (64, 512, torch.bfloat16)])
def test_cache_attention_cuda_takes_prefill_chunks(monkeypatch, cluster, d, t, dtype):
    # The split-KV kernel takes chunks of a prompt (t past 16 queries, causal within the chunk) of up
    # to 512 queries for every row in one launch, lengths on the device: rows of different lengths,
    # through slots, in and out of a CUDA graph. With CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES below t
    # such a chunk takes the generic path, which reads the lengths on the host and raises for one
    # out of range; the kernel gives that sequence NaN rows instead. A block stops at its last
    # query's bound: batch 1 splits its keys (merged in clusters, or by the merge kernel; 2 splits of
    # 128 keys for t = 32 on an H100 or H200), and 32 queries at length 130 leave the first 16
    # queries' block no keys in the second split.
    if cluster:
        monkeypatch.setenv("CUSTOMOPS_CACHE_ATTENTION_CLUSTER", cluster)
    else:
        monkeypatch.delenv("CUSTOMOPS_CACHE_ATTENTION_CLUSTER", raising=False)
    g = torch.Generator().manual_seed(d + t)
    size = 4096
    cases = [([t, 300 + t, 4096, 4097], [3, 0, 2, 1]), ([t + 98], [0]), ([4000], [0])]
    for lengths, slots in cases:
        b = len(lengths)
        q = torch.randn(b, 32, t, d, generator=g).to("cuda", dtype)
        k_cache, v_cache = (torch.randn(4, 8, size, d, generator=g).to("cuda", dtype) for _ in range(2))
        lens, where = torch.tensor(lengths, device="cuda"), torch.tensor(slots, device="cuda")
        if max(lengths) > size:
            monkeypatch.setenv("CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES", str(t - 1))
            with pytest.raises(RuntimeError, match="cache_attention.*4097"):
                customops.cache_attention(q, k_cache, v_cache, lens, slots=where)
        monkeypatch.delenv("CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES", raising=False)
        out, lse = customops.cache_attention(q, k_cache, v_cache, lens, slots=where)
        graph, static = torch.cuda.CUDAGraph(), q.clone()
        customops.cache_attention(static, k_cache, v_cache, lens, slots=where)  # (warm-up outside the capture)
        with torch.cuda.graph(graph):
            replayed = customops.cache_attention(static, k_cache, v_cache, lens, slots=where)
        graph.replay()
        torch.testing.assert_close(replayed[0], out, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(replayed[1], lse, atol=0, rtol=0, equal_nan=True)
        _matches_attention_on_each_length(q, k_cache, v_cache, out, lse, lengths, slots)
    monkeypatch.setenv("CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES", "many")
    with pytest.raises(RuntimeError, match="CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES must be a count"):
        customops.cache_attention(q, k_cache, v_cache, lens, slots=where)


@pytest.mark.skipif(not any(d == "cuda" for d in DEVICES), reason="the CUDA kernel's paths")
def test_cache_attention_cuda_sends_a_long_prefill_chunk_to_the_generic_path():
    # Past 512 queries a sequence the generic path attends (the faster there: 2048 ids alone), and
    # reads the lengths on the host: one out of range raises.
    q = torch.randn(1, 4, 513, 64, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 1, 600, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cache_attention.*601"):
        customops.cache_attention(q, k_cache, k_cache, torch.tensor([601], device="cuda"))
    out, lse = customops.cache_attention(q, k_cache, k_cache, torch.tensor([600], device="cuda"))
    _matches_attention_on_each_length(q, k_cache, k_cache, out, lse, [600], [0])


@pytest.mark.skipif(not any(d == "cuda" for d in DEVICES), reason="the CUDA kernel's tiles")
@pytest.mark.parametrize("warps", ["4", "8"], ids=["4-warps", "8-warps"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cache_attention_cuda_ignores_the_cache_past_each_length(monkeypatch, warps, d):
    # Enough sequences for one split each, lengths around the tiles' edges (64 and 128 keys), NaN in
    # the cache past each length: the last tile's rows past it must not reach the output.
    monkeypatch.setenv("CUSTOMOPS_CACHE_ATTENTION_WARPS", warps)
    g = torch.Generator().manual_seed(d)
    lengths = [1, 2, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 511]
    b, s = len(lengths), 512
    q = torch.randn(b, 32, 1, d, generator=g).to("cuda", torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, 8, s, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    for i, n in enumerate(lengths):
        k_cache[i, :, n:] = float("nan")
        v_cache[i, :, n:] = float("nan")
    out, lse = customops.cache_attention(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"))
    for i, n in enumerate(lengths):
        o, l = customops.attention(q[i:i + 1].float(), k_cache[i:i + 1, :, :n].float(), v_cache[i:i + 1, :, :n].float(),
                                   return_lse=True)
        torch.testing.assert_close(out[i:i + 1].float(), o, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[i:i + 1], l, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_cache_write_writes_each_sequence_at_its_start_in_place(device):
    k_cache, v_cache = torch.zeros(3, 2, 8, 4, device=device), torch.zeros(3, 2, 8, 4, device=device)
    k = torch.randn(2, 3, 2, 4, device=device).transpose(1, 2)  # [B, Hkv, T, D] as a model passes it
    v = torch.randn(2, 2, 3, 4, device=device)
    start = torch.tensor([0, 5], device=device)
    version = k_cache._version
    customops.cache_write(k_cache, v_cache, k, v, start)
    assert k_cache._version > version  # autograd sees the write
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[0, :, 0:3], want_k[1, :, 5:8] = k[0], k[1]
    want_v[0, :, 0:3], want_v[1, :, 5:8] = v[0], v[1]
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)
    op = torch.ops.customops.cache_write.default
    torch.library.opcheck(op, (k_cache, v_cache, k, v, start))
    torch.library.opcheck(op, (k_cache, v_cache, k[:, :, :0], v[:, :, :0], start))  # no new positions
    with pytest.raises(RuntimeError, match="customops::cache_write: expected v to have the dtype of k_cache"):
        customops.cache_write(k_cache, v_cache, k, v.double(), start)
    with pytest.raises(RuntimeError, match=r"customops::cache_write: expected k of shape \[B, Hkv, T, D\] with the"):
        customops.cache_write(k_cache, v_cache, k[:, :1], v[:, :1], start)
    with pytest.raises(RuntimeError, match=r"customops::cache_write: expected start of shape \[B\] = \[2\]"):
        customops.cache_write(k_cache, v_cache, k, v, start[:1])
    with pytest.raises(RuntimeError, match="customops::cache_write is not differentiable"):
        customops.cache_write(k_cache, v_cache, k.requires_grad_(), v, start)
    k = k.detach()
    # written in place: an expanded cache would take every sequence's rows in one place, and a
    # cache passed as both would take v over k (ATen's in-place ops refuse both alike)
    expanded = torch.zeros(1, 2, 8, 4, device=device).expand(3, 2, 8, 4)
    cos, sin = (torch.ones(2, 3, 4, device=device) for _ in range(2))
    for write in (lambda kc, vc: customops.cache_write(kc, vc, k, v, start),
                  lambda kc, vc: customops.rope_cache_write(kc, vc, k, k, v, cos, sin, start)):
        with pytest.raises(RuntimeError, match="k_cache has elements that share memory"):
            write(expanded, v_cache)
        with pytest.raises(RuntimeError, match="v_cache has elements that share memory"):
            write(k_cache, expanded)
        with pytest.raises(RuntimeError, match="k_cache and v_cache share memory"):
            write(k_cache, k_cache)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"customops::cache_write: start\[1\] is 6; its 3 new positions must fit"):
            customops.cache_write(k_cache, v_cache, k, v, torch.tensor([0, 6]))
    else:  # read on the device: rows past the cache are not written
        before = k_cache.clone()
        customops.cache_write(k_cache, v_cache, k, v, torch.tensor([0, 6], device=device))
        torch.testing.assert_close(k_cache[1, :, 6:8], k[1, :, :2], atol=0, rtol=0)
        torch.testing.assert_close(k_cache[1, :, :6], before[1, :, :6], atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_cache_write_under_autocast_follows_the_caches_dtype(device):
    # rope casts k, cos and sin to q's dtype under autocast; the fused op casts q, k, v, cos and sin
    # to the caches' (written in place, they keep theirs): Hugging Face's float32 cos and sin work
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 3, 16, generator=g).to(device) for h in (4, 2, 2))
    cos, sin = (torch.rand(2, 3, 16, generator=g).to(device) for _ in range(2))
    kc, vc = (torch.zeros(2, 2, 8, 16, device=device, dtype=torch.bfloat16) for _ in range(2))
    start = torch.tensor([0, 5], device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got = customops.rope_cache_write(kc, vc, q, k.bfloat16(), v, cos, sin, start)
    kw, vw = torch.zeros_like(kc), torch.zeros_like(vc)
    want = customops.rope_cache_write(kw, vw, *(t.bfloat16() for t in (q, k, v, cos, sin)), start)
    assert got.dtype == torch.bfloat16
    for a, b in ((got, want), (kc, kw), (vc, vw)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_cache_write_stays_in_place_in_the_package(packaged):
    # The package's graph calls rope_cache_write on the cache buffers themselves: no copy of a cache
    import zipfile

    _, path = packaged
    with zipfile.ZipFile(path) as z:
        (wrapper,) = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        code = z.read(wrapper).decode()
    calls = [line for line in code.splitlines() if "proxy_executor_call_function" in line and "{k_cache_0, v_cache_0," in line]
    assert len(calls) == 1, "rope_cache_write is not called on the package's own cache buffers"
    assert not [line for line in code.splitlines() if "copy_" in line and "k_cache_0" in line]
