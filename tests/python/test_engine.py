"""customops::Engine (customops/engine.h), continuous batching over a causal-LM package, driven step
by step through the consumer program engine_api: requests that arrive while others decode, more
requests than slots, prompts prefilled in chunks beside decoding rows, stop ids, cancels, and each
request's ids the same as its own alone (Hugging Face's greedy ids on the CPU). The models are
float32, where a row's result does not depend on the shape of the run it is in. On CUDA one more
test runs a bfloat16 model of head dim 64, whose decode steps replay CUDA graphs one step ahead of
the host; there a chunked prompt is not compared (a chunk of a few rows runs other kernels than a
whole prompt, and bfloat16 rounds them apart: measured on an H100, one first id of seven changed)."""

from __future__ import annotations

import pytest
import torch

import customops
from causal_lms import VOCAB, api, hf_generate, ids_of, prompts
from conftest import DEVICES
from test_aoti import run

pytest.importorskip("transformers")

MAX_BATCH, MAX_SEQ_LEN = 3, 40


@pytest.fixture(scope="module", params=DEVICES)
def lm(request, tmp_path_factory):
    """(model, package path, device): a Llama of head dim 64 packaged with 3 slots of 40 positions."""
    import causal_lms

    model = causal_lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(request.param)
    path = customops.export.package_causal_lm(model, tmp_path_factory.mktemp("engine") / "llama.pt2",
                                              max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    return model, path, request.param


def engine(consumer, path, script, *args, tmp_path, env=None):
    """engine_api's result: {request: (reason, updates, ids)}, and its stderr (steps, graph steps)."""
    (tmp_path / "script").write_text("".join(line + "\n" for line in script))
    r = run([consumer / "engine_api", path, *args, tmp_path / "script"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = {}
    for line in r.stdout.splitlines():
        k, reason, updates, *ids = line.split(" error: ")[0].split()
        out[int(k)] = (reason, int(updates), list(map(int, ids)))
    return out, r.stderr


def submit(step, prompt, **options):
    words = [f"{k}={v}" if v is not True else k for k, v in options.items()]
    return " ".join([str(step), "submit", *words, ":", *map(str, prompt)])


def alone(consumer, path, prompt, n, ignore_eos=True, env=None):
    """The package's ids for prompt alone (CausalLM::generate, one prompt)."""
    r = api(consumer, path, "--max-new-tokens", str(n), "--prompt", " ".join(map(str, prompt)),
            *(["--ignore-eos"] if ignore_eos else []), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return ids_of(r.stdout)[0]


def test_requests_that_come_and_go_get_their_ids_alone(lm, consumer, tmp_path):
    """Seven requests over three slots, arriving while others decode, with a budget that prefills
    the longer prompts in chunks beside the decoding rows: each request's ids, streamed one a step,
    are its ids alone (Hugging Face's greedy ids on the CPU), and the ones that found every slot
    taken waited for one."""
    model, path, device = lm
    ps = prompts(5, 17, 3, 11, 30, 2, 8, seed=4)
    arrivals = [0, 0, 2, 3, 3, 9, 10]
    n = [12, 6, 9, 10, 7, 5, 8]
    script = [submit(a, p, max=k) for a, p, k in zip(arrivals, ps, n)]
    for budget in ("9", "1000"):
        got, stderr = engine(consumer, path, script, "--budget", budget, tmp_path=tmp_path)
        for k, (p, m) in enumerate(zip(ps, n)):
            reason, updates, ids = got[k]
            want = hf_generate(model, p, m) if device == "cpu" else alone(consumer, path, p, m, ignore_eos=False)
            assert ids == want, (budget, k)
            assert reason == ("length" if len(want) == m and want[-1] != model.config.eos_token_id else "stop")
            assert updates == len(want)  # streamed as sampled: one id a step


@pytest.fixture(scope="module")
def bf16_cuda_package(tmp_path_factory):
    """A bfloat16 Llama of head dim 64 packaged for CUDA (once: the three rules below share it)."""
    import causal_lms

    model = causal_lms.llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to("cuda", torch.bfloat16)
    return customops.export.package_causal_lm(model, tmp_path_factory.mktemp("engine-bf16") / "llama.pt2",
                                              max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
@pytest.mark.parametrize("rule", ["default", "generic-chunks", "split-kv-chunks"])
def test_cuda_graph_steps_give_each_request_its_ids_alone(bf16_cuda_package, consumer, tmp_path, rule):
    """bfloat16, head dim 64: decode steps of each batch size replay a CUDA graph, one step ahead of
    the host, between the eager steps that admit prompts (whole: the budget takes them). By default
    every chunk here (at most 40 queries) attends through the split-KV kernel. With the kernel's
    limit at 16 queries (CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES, as for prompts past 512 ids), the
    prompts admitted beside decoding rows (up to 30 ids) take the kernel by the engine's rule, or
    the generic path with CUSTOMOPS_ENGINE_CHUNK_ATTENTION=0. The two round differently (both match
    attention within bfloat16's tolerance: test_generate) and this random model's greedy choices
    are close calls, so each prompt alone is prefilled through the path the engine gave it."""
    path = bf16_cuda_package
    ps = prompts(5, 17, 3, 11, 30, 2, 8, seed=4)
    n = [12, 6, 9, 10, 7, 5, 8]
    arrivals = [0, 0, 2, 3, 3, 9, 10]
    script = [submit(a, p, max=k, ignore_eos=True) for a, p, k in zip(arrivals, ps, n)]
    limit = {} if rule == "default" else {"CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES": "16"}
    got, stderr = engine(consumer, path, script, "--budget", "1000", tmp_path=tmp_path,
                         env={**limit, "CUSTOMOPS_ENGINE_CHUNK_ATTENTION": "0" if rule == "generic-chunks" else "1"})
    for k, (a, p, m) in enumerate(zip(arrivals, ps, n)):
        beside_decoding = a > 0  # (arrivals past step 0 find rows decoding)
        env = {"CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES": str(MAX_SEQ_LEN)} if rule == "split-kv-chunks" and beside_decoding \
            else limit
        assert got[k] == ("length", m, alone(consumer, path, p, m, env=env)), k
    assert int(stderr.split()[3]) > 0, stderr  # decode steps replayed from CUDA graphs


def stats(stderr):
    """engine_api's engine statistics: {"steps": ..., "graph_runs": ..., "runs": ..., "tokens": ...}."""
    words = stderr.split()
    return {k: int(v) for k, v in zip(words[::2], words[1::2])}


def test_a_prompt_admitted_beside_decoding_requests_runs_alone(lm, consumer, tmp_path):
    """A long prompt admitted while another request decodes is prefilled in its own run beside the
    decode run, over its own slot: the decoding row computes one position a step, never the
    chunk's length, and the engine plans each prompt id and each fed-back id once (no padding).
    The request in slot 0 ends first, and the one after it is admitted while slot 1 decodes. (Prefill
    multiple 1: CUDA's default pads chunks, test_requests_from_other_threads runs that.)"""
    model, path, device = lm
    ps = prompts(4, 30, 9, seed=9)
    script = [submit(0, ps[0], max=12, ignore_eos=True), submit(3, ps[1], max=6, ignore_eos=True),
              submit(12, ps[2], max=5, ignore_eos=True)]
    got, stderr = engine(consumer, path, script, "--budget", "8", tmp_path=tmp_path,
                         env={"CUSTOMOPS_PREFILL_MULTIPLE": "1"})
    for k, (p, m) in enumerate(zip(ps, (12, 6, 5))):
        assert got[k] == ("length", m, alone(consumer, path, p, m)), k
    st = stats(stderr)
    # prompts once, and each id after a request's first fed back once: no padded position
    assert st["tokens"] == sum(map(len, ps)) + (12 - 1) + (6 - 1) + (5 - 1), stderr
    assert st["runs"] > st["steps"], stderr  # steps with a decode run and a prefill run


def test_stop_ids_eos_max_tokens_and_a_full_cache_end_a_request(lm, consumer, tmp_path):
    model, path, device = lm
    long = prompts(MAX_SEQ_LEN - 3, seed=5)[0]
    for seed in range(5, 40):  # a prompt whose ids reach, after two, an id they had not
        p = prompts(6, seed=seed)[0]
        free = alone(consumer, path, p, 10)
        stop = next((i for i in free[2:] if i not in free[:2]), None)
        if stop is not None:
            break
    script = [submit(0, p, max=10, stop=stop, ignore_eos=True), submit(0, p, max=4, ignore_eos=True),
              submit(1, long, max=10, ignore_eos=True)]
    got, _ = engine(consumer, path, script, tmp_path=tmp_path)
    assert got[0][0] == "stop" and got[0][2] == free[:free.index(stop) + 1]
    assert got[1][0] == "length" and got[1][2] == free[:4]
    # 37 prompt positions of 40: the first new id and three fed back fill the cache
    assert got[2][0] == "length" and got[2][2] == alone(consumer, path, long, 10)[:4]


def test_a_cancelled_request_frees_its_slot_for_the_next(lm, consumer, tmp_path):
    """Three slots taken by long requests and two waiting: cancelling the second at step 4 ends it
    there and admits the fourth, which gets its ids alone and finishes before the others; the fifth,
    cancelled while it waits, ends without running."""
    model, path, device = lm
    ps = prompts(4, 6, 5, 7, seed=6)
    script = [submit(0, p, max=30, ignore_eos=True) for p in ps[:3]] + [
        submit(1, ps[3], max=5, ignore_eos=True), submit(1, ps[0], max=5), "2 cancel 4", "4 cancel 1", "30 cancel 0"]
    got, stderr = engine(consumer, path, script, tmp_path=tmp_path)
    assert got[4] == ("cancelled", 0, [])  # cancelled while it waited: it never ran
    assert got[1][0] == "cancelled" and len(got[1][2]) <= 5
    assert got[3] == ("length", 5, alone(consumer, path, ps[3], 5))
    for k in (0, 2):  # request 0's cancel came after its last id: ignored
        assert got[k] == ("length", 30, alone(consumer, path, ps[k], 30))
    # the waiting request ran in the cancelled one's slot, beside the others: no more steps than
    # the longest request's prefill and 30 ids, and the cancel after every request ended ignored
    assert int(stderr.split()[1]) <= 31, stderr


def test_sampling_is_each_requests_own(lm, consumer, tmp_path):
    """A sampling request draws from its own seeded generator: the same ids alone and beside
    others, which sample with other options, or with the same options and other seeds (the engine
    shapes the distributions of rows with the same options at once), or are greedy."""
    model, path, device = lm
    ps = prompts(5, 9, 3, seed=7)
    sampled = dict(max=12, temp=2, top_k=40, top_p=0.9, seed=11, ignore_eos=True)
    first, _ = engine(consumer, path, [submit(0, ps[0], **sampled)], tmp_path=tmp_path)
    assert len(first[0][2]) == 12
    greedy = submit(1, ps[2], max=12, ignore_eos=True)
    for crowd in ([submit(0, ps[1], max=12, temp=3, seed=1, ignore_eos=True), greedy],
                  [submit(0, ps[1], **{**sampled, "seed": 5}), greedy],
                  [submit(0, ps[1], **{**sampled, "seed": 5}), submit(1, ps[2], **{**sampled, "seed": 6})]):
        again, _ = engine(consumer, path, [*crowd, submit(2, ps[0], **sampled)], "--budget", "8", tmp_path=tmp_path)
        assert again[2][2] == first[0][2], crowd
    other, _ = engine(consumer, path, [submit(0, ps[0], **{**sampled, "seed": 12})], tmp_path=tmp_path)
    assert other[0][2] != first[0][2]


@pytest.mark.parametrize("multiple", ["", "8"], ids=["plain", "padded-and-warmed"])
def test_requests_from_other_threads(lm, consumer, tmp_path, multiple):
    """The engine on its own thread (start()), every request submitted at once: each gets its ids
    alone. With CUSTOMOPS_PREFILL_MULTIPLE=8 the thread first runs every padded prefill shape once
    (1-3 rows of 8, 16, ... 40 pad ids, into the caches of slots no request holds yet) and pads each
    chunk: the same ids. (On CUDA, where the engine pads to 64 unless told, a padded chunk runs
    other kernels than the prompt alone, which round apart in float32; the greedy ids agree.)"""
    model, path, device = lm
    ps = prompts(3, 12, 7, 20, 5, seed=8)
    got, _ = engine(consumer, path, [submit(0, p, max=6, ignore_eos=True) for p in ps], "--thread",
                    tmp_path=tmp_path, env={"CUSTOMOPS_PREFILL_MULTIPLE": multiple})
    for k, p in enumerate(ps):
        assert got[k][0] == "length" and got[k][2] == alone(consumer, path, p, 6)


@pytest.mark.parametrize("request_line,error", [
    ("0 submit :", "the prompt is empty"),
    (f"0 submit : 3 {VOCAB}", rf"the prompt holds id {VOCAB} at position 1, outside the vocabulary \[0, {VOCAB}\)"),
    ("0 submit : " + " ".join(["3"] * (MAX_SEQ_LEN + 1)),
     f"the prompt has {MAX_SEQ_LEN + 1} ids, more than the package's max_seq_len \\({MAX_SEQ_LEN}\\)"),
    ("0 submit max=0 : 3", "max_new_tokens must be at least 1"),
    ("0 submit temp=-1 : 3", "temperature must be a finite number >= 0"),
    ("0 submit top_p=0 : 3", r"top_p must be in \(0, 1\]"),
], ids=["empty", "id", "long", "max", "temperature", "top_p"])
def test_a_bad_request_is_refused_when_submitted(lm, consumer, tmp_path, request_line, error):
    import re

    _, path, _ = lm
    (tmp_path / "script").write_text(request_line + "\n")
    r = run([consumer / "engine_api", path, tmp_path / "script"])
    assert r.returncode == 3 and re.fullmatch("invalid_argument: " + error + ".*", r.stdout.strip()), r.stdout
