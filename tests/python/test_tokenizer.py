"""customops::Tokenizer on tokenizer.json files against Hugging Face's tokenizers library: byte-level
BPE tokenizers trained here (as Llama-3, Qwen2, GPT-2 and Mistral-Nemo describe theirs: the pre-tokenizer
regexes, NFC, ignore_merges, added and special tokens) encode and decode every text of a
multilingual corpus (scripts, emoji, whitespace runs, digits, contractions, special tokens written
in the text) exactly as tokenizers does; TextStream's pieces never split a character and add up to
the whole decode. Through the consumer program tokenize_api (C++ API) and customops-run generate."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

import customops

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from test_aoti import run  # noqa: E402

if "tokenizer.json" not in run([customops.runner_path(), "--version"]).stdout:
    pytest.skip("customops was built without tokenizer.json support (Debian: nlohmann-json3-dev libpcre2-dev "
                "libutf8proc-dev)", allow_module_level=True)

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
         r"|\s+")
# Mistral-Nemo's (Tekken's): letters split by case (CamelCase into words), marks with letters, no
# contractions, one digit a piece
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ["the", "quick", "brown", "fox", "Straße", "naïve", "café", "résumé", "Ωμέγα", "Привет", "мир", "こんにちは",
         "世界", "東京都", "안녕하세요", "مرحبا", "नमस्ते", "שלום", "ภาษาไทย", "Tiếng Việt", "I'm", "DON'T", "we'VE",
         "12345678", "3.14159", "٣٤٥", "½", "x²", "🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "∑∫√", "def f(x):", "return x**2",
         "$100", "e\u0301", "\u00a0", "\u2003", "\u3000", "\u200b", "a_b", "--", "!!!", "...", "?!", "CamelCase",
         "HTTPServer", "iPhone", "ǅemal", "İstanbul", "a/b/c", "ʰʲ", "ﬁ"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t", "    \n"]


def _corpus(n, seed, special=()):
    """n texts: words of many scripts joined by whitespace runs, some special tokens inside."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 14)):
            parts.append(rng.choice(WORDS) if not special or rng.random() > 0.08 else rng.choice(special))
            parts.append(rng.choice(SPACES) if rng.random() < 0.3 else " ")
        out.append("".join(parts[:-1] if rng.random() < 0.7 else parts))
    return out + ["", " ", "\n", "  leading and trailing  ", "a" * 300, "9" * 40, "🙂" * 20]


def _train(kind, vocab_size=600):
    """A tokenizers.Tokenizer of one of the families' designs, trained on the corpus."""
    special = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
               "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "gpt2": ["<|endoftext|>"],
               "nemo": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]}[kind]
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"), byte_level])
    elif kind == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"), byte_level])
    elif kind == "nemo":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(TEKKEN), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(400, seed=0), trainer=trainer)
    tok.add_tokens([tokenizers.AddedToken("<tool>", normalized=False), tokenizers.AddedToken(" [SEP] ", lstrip=True)])
    return tok, special


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gpt2", "nemo"])
def trained(request, tmp_path_factory):
    tok, special = _train(request.param)
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    tok.save(str(path))
    return tok, path, special


def _api(consumer, tokenizer, command, lines, tmp_path):
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines))
    r = run([consumer / "tokenize_api", tokenizer, command, tmp_path / "in.txt"])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


def test_encode_is_tokenizers_encode(trained, consumer, tmp_path):
    tok, path, special = trained
    texts = _corpus(300, seed=1, special=special + ["<tool>", " [SEP] "])
    got = _api(consumer, path, "encode", [t.encode().hex() for t in texts], tmp_path)
    for text, line in zip(texts, got):
        assert list(map(int, line.split())) == tok.encode(text, add_special_tokens=False).ids, repr(text)


def test_encode_is_tokenizers_encode_on_random_characters(trained, consumer, tmp_path):
    """Strings of random code points: ASCII, every kind of whitespace, and any character Unicode
    14 assigns (PCRE2's tables; a character assigned later may pre-tokenize otherwise, as
    tokenizers' regex engine knows newer ones)."""
    import unicodedata

    tok, path, _ = trained
    rng = random.Random(6)
    spaces = [0x9, 0xA, 0xB, 0xC, 0xD, 0x85, 0xA0, 0x1680, 0x2000, 0x2007, 0x200A, 0x200B, 0x2028, 0x2029, 0x202F,
              0x205F, 0x3000, 0xFEFF, 0x180E]

    def char():
        r = rng.random()
        if r < 0.3:
            return chr(rng.randrange(0x20, 0x7F))
        if r < 0.45:
            return chr(rng.choice(spaces))
        while True:
            c = chr(rng.randrange(0x80, 0x30000))
            if unicodedata.category(c) not in ("Cn", "Cs"):
                return c

    texts = ["".join(char() for _ in range(rng.randint(1, 40))) for _ in range(1000)]
    got = _api(consumer, path, "encode", [t.encode().hex() for t in texts], tmp_path)
    for text, line in zip(texts, got):
        assert list(map(int, line.split())) == tok.encode(text, add_special_tokens=False).ids, repr(text)


def _id_sequences(tok, seed, texts, random_seqs, longest):
    """The ids of `texts` corpus texts, then `random_seqs` sequences of random ids (up to `longest`)."""
    rng = random.Random(seed)
    n = tok.get_vocab_size()
    seqs = [tok.encode(t, add_special_tokens=False).ids for t in _corpus(texts, seed=seed + 1)]
    return seqs + [[rng.randrange(n) for _ in range(rng.randint(1, longest))] for _ in range(random_seqs)]


def test_decode_is_tokenizers_decode_of_any_ids(trained, consumer, tmp_path):
    """Any ids, those that give bytes that are not UTF-8 too (each maximal bad run one U+FFFD, as
    Rust's from_utf8_lossy), special tokens skipped."""
    tok, path, _ = trained
    seqs = _id_sequences(tok, 2, texts=50, random_seqs=200, longest=30)
    got = _api(consumer, path, "decode", [" ".join(map(str, s)) for s in seqs], tmp_path)
    for ids, line in zip(seqs, got):
        assert bytes.fromhex(line).decode() == tok.decode(ids, skip_special_tokens=True), ids


def test_a_text_stream_never_splits_a_character(trained, consumer, tmp_path):
    """Each push is whole characters; it waits for the last 3 ids that give bytes, which may still
    complete one (or more, where those ids' boundaries cut characters): bytes that are not UTF-8
    and that no later id can complete (a run of continuation bytes, as a model repeating a byte id
    gives) are sent as U+FFFD 3 ids later, not at the end. What is pushed and finished is decode()
    of all the ids."""
    tok, path, _ = trained
    # byte 0x80 as byte-level BPE spells it (GPT-2's bytes_to_unicode: the 35th byte that is not printable)
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    continuation = tok.token_to_id(chr(256 + sorted(set(range(256)) - printable).index(0x80)))
    stuck = [continuation] * 12  # 12 lone continuation bytes
    seqs = _id_sequences(tok, 4, texts=40, random_seqs=100, longest=40) + [stuck, [tok.token_to_id("a")] + stuck]
    got = _api(consumer, path, "stream", [" ".join(map(str, s)) for s in seqs], tmp_path)
    for ids, line in zip(seqs, got):
        pushed, finished = line.split(";")
        pieces = [bytes.fromhex(p) for p in pushed.split(",")]
        text = "".join(p.decode() for p in pieces)  # whole characters only (raises otherwise)
        assert text + bytes.fromhex(finished).decode() == tok.decode(ids, skip_special_tokens=True), ids
        # what is left to finish comes from the last 3 ids that give bytes
        giving = [i for i in ids if tok.decode([i], skip_special_tokens=True)]
        assert text.startswith(tok.decode(giving[:-3])) or tok.decode(giving[:-3]).endswith("\ufffd"), ids
    assert got[-2].split(";")[0].replace(",", "") == "efbfbd" * 9  # 9 of the 12 sent, 3 wait


def test_a_save_pretrained_folder_gives_the_bos_and_eos_of_its_config(tmp_path, consumer):
    transformers = pytest.importorskip("transformers")
    tok, special = _train("llama3")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[2])
    fast.save_pretrained(tmp_path / "folder")
    r = run([consumer / "tokenize_api", tmp_path / "folder", "info"])
    vocab, bos, eos = map(int, r.stdout.split())
    assert (vocab, bos, eos) == (tok.get_vocab_size(), fast.bos_token_id, fast.eos_token_id), r.stdout


@pytest.mark.parametrize("case", ["wordpiece", "not json", "no model", "unknown normalizer"])
def test_a_tokenizer_json_it_does_not_read_is_named(case, tmp_path, consumer):
    path = tmp_path / "tokenizer.json"
    if case == "wordpiece":
        wp = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        wp.save(str(path))
        error = r"its model \(WordPiece\) is one customops does not implement"
    elif case == "not json":
        path.write_text("{not json")
        error = "is not a tokenizer.json"
    elif case == "no model":
        path.write_text(json.dumps({"version": "1.0"}))
        error = r"is not a tokenizer.json \(no model\)"
    else:
        tok, _ = _train("gpt2", vocab_size=300)
        doc = json.loads(tok.to_str())
        doc["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": ""}
        path.write_text(json.dumps(doc))
        error = r"its normalizer \(Precompiled\) is one customops does not implement"
    r = run([consumer / "tokenize_api", path, "info"])
    assert r.returncode == 3 and r.stdout.startswith("invalid_argument: ") and re.search(error, r.stdout), r.stdout


def test_customops_run_generate_takes_text_through_a_tokenizer_json(tmp_path):
    """--tokenizer with a tokenizer.json: each prompt encoded as tokenizers does, after the bos
    id, and the new ids decoded into the line."""
    transformers = pytest.importorskip("transformers")
    import causal_lms as lms

    tok, special = _train("llama3", vocab_size=320)
    folder = tmp_path / "tok"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[1])
    fast.save_pretrained(folder)
    model = lms.llama(vocab_size=tok.get_vocab_size(), bos_token_id=fast.bos_token_id, eos_token_id=None)
    model.generation_config.eos_token_id = None
    path = customops.export.package_causal_lm(model, tmp_path / "lm.pt2", max_batch=2, max_seq_len=48)
    texts = ["the quick brown fox", "こんにちは 世界 🙂"]
    r = lms.generate(path, "--tokenizer", folder, *[a for t in texts for a in ("--prompt", t)], "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    ids = [[fast.bos_token_id] + tok.encode(t, add_special_tokens=False).ids for t in texts]
    by_ids = lms.generate(path, *lms.prompt_args(ids), "--max-new-tokens", "8")
    want = [tok.decode(list(map(int, line.split())), skip_special_tokens=True).replace("\\", "\\\\").replace("\n", "\\n")
            for line in by_ids.stdout.splitlines()]
    assert r.stdout.splitlines() == want, (r.stdout, want)
