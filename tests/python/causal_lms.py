"""What the generation tests share: small Hugging Face causal LMs, prompts, Hugging Face's greedy
ids, and the two ways to generate from a package without Python (``customops-run generate`` and
the C++ API through the consumer program generate_api, which prints what it threw)."""

from __future__ import annotations

import re

import torch

import customops
from test_aoti import run  # the runner's environment: no Python on its path

MAX_BATCH, MAX_SEQ_LEN, VOCAB = 2, 24, 256


def llama(**config):
    """A 2-layer float32 Llama of VOCAB ids (bos 1, eos 2) whose greedy ids do not hinge on rounding."""
    import transformers

    cfg = transformers.LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                             max_position_embeddings=256, attn_implementation="sdpa"), **config})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # well-separated logits
        model.lm_head.weight.mul_(20)
    return model


def prompts(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_generate(model, prompt, n):
    """model.generate's n greedy new ids for prompt alone (fewer where an eos id ends it), from a
    fresh rotary state ("dynamic" rope keeps the frequencies it grew to for the next call)."""
    rotary = model.model.rotary_emb
    if hasattr(rotary, "original_inv_freq"):
        rotary.inv_freq, rotary.max_seq_len_cached = rotary.original_inv_freq.clone(), rotary.original_max_seq_len
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device))
    return out[0, len(prompt):].tolist()


def prompt_args(ps) -> list[str]:
    return [a for p in ps for a in ("--prompt", " ".join(map(str, p)))]


def generate(path, *args):
    """customops-run generate PATH ARGS."""
    return run([customops.runner_path(), "generate", path, *args])


def api(consumer, path, *args, env=None):
    """generate_api PATH ARGS: the C++ API's new ids, or one line naming what it threw (exit 3)."""
    return run([consumer / "generate_api", path, *args], env=env)


def ids_of(stdout: str) -> list[list[int]]:
    return [list(map(int, line.split())) for line in stdout.splitlines()]


def one_line_error(r, pattern: str = "") -> str:
    """The runner's error: exit 1 or 2 and one line on stderr (matching pattern), nothing on stdout."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode in (1, 2) and len(lines) == 1 and not r.stdout, (r.returncode, r.stdout, r.stderr)
    assert lines[0].startswith("customops-run: ") and re.search(pattern, lines[0]), lines[0]
    return lines[0]


def api_error(r, kind: str, pattern: str = "") -> str:
    """The API's error: exit 3, and one line naming the exception it threw (matching pattern)."""
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 3 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    assert lines[0].startswith(kind + ": ") and re.search(pattern, lines[0]), lines[0]
    return lines[0]
