"""``python -m customops bench --serve``: ``customops-run serve`` under load, against ``customops-run
generate`` of the same batch and against the decode floor.

The model is :mod:`.generate`'s (Llama-3.2-1B shapes on CUDA, a small config on CPU), packaged once
with ``max_batch`` the largest concurrency. For each concurrency C the server runs with
``--max-batch C`` and C streaming clients (threads, raw HTTP, each on one connection it keeps
alive, as OpenAI's clients do) each send ``--requests`` completions one after another: prompts of
mixed lengths (token ids, a quarter to all of ``--prompt-len``; with ``--same-length`` all of it),
each ``--new-tokens`` greedy tokens. Reported: output tokens/s over
the wall time; time to first token (TTFT) and inter-token latency (ITL: a request's time from its
first to its last token over its tokens after the first) at their p50 and p99 over the requests; and
the largest gap between two chunks of a stream (a stall, such as a prefill chunk beside decoding
rows); and the mean TTFT the server measures itself (its /metrics), which leaves out the HTTP path
and the text. Beside them, ``customops-run generate`` of C of the same prompts at once: its tokens/s
(C x new tokens over its prefill and decode time) and its decode ms/token; the prefill of a prompt
of the median length alone (what TTFT at concurrency 1 compares with); and the floor: the bytes a
decode step of C rows reads at the copy speed measured here.

The tokenizer is one made here whose every id decodes to one to three ASCII letters, so that each
token is a chunk of text the server can send at once.

``--variant VAR=VALUE[,VAR=VALUE]`` (repeatable) runs the server again at each concurrency with
those environment variables set (a kernel's switches), e.g.
``CUSTOMOPS_CACHE_ATTENTION_MAX_QUERIES=64`` for prefill chunks on the split-KV kernel.

With ``--llama-cpp DIR`` (a llama.cpp checkout with ``build/bin/llama-server`` built), the same
model is converted by llama.cpp's own ``convert_hf_to_gguf.py`` (same dtype, or ``--gguf-type``'s:
f16 for a llama.cpp older than its bf16 CUDA kernels) and ``llama-server``
(``--parallel C``, a context of C full sequences, every layer on the GPU under CUDA) takes the same
clients and prompts (token ids, ``ignore_eos``), the bar the serving issue set.

``--temperature T`` (with ``--top-k`` and ``--top-p``) has every timed request sample with those
options (a seed of its own) instead of decoding greedily, and ``customops-run generate`` and
llama-server sample with them too: what a server spends on sampling, which greedy rows skip. The
greedy text compared with llama-server's stays greedy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import customops

from .. import _cli
from .attention import parse_variant, variant_label
from .common import pick_device, versions, write_json
from .generate import _copy_speed, _model


def _tokenizer_json(vocab_size: int, path: Path) -> None:
    """A byte-level BPE tokenizer.json of vocab_size ids: the 256 bytes, then two- and three-letter
    ASCII words (each a merge of a shorter one and a letter)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    merges = []
    words = [a + b for a in letters for b in letters] + [a + b + c for a in letters for b in letters for c in letters]
    for w in words:
        if len(vocab) >= vocab_size:
            break
        vocab[w] = len(vocab)
        merges.append([w[:-1], w[-1]])
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}
    path.write_text(json.dumps(spec))


class _Server:
    """customops-run serve on a package; its output goes to a file, whose end an error quotes."""

    def __init__(self, package, tokenizer, max_batch, env=None):
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([customops.runner_path(), "serve", package, "--tokenizer", tokenizer, "--port",
                                      "0", "--max-batch", str(max_batch)], stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 300
        while True:
            self.log.seek(0)
            # (anywhere in the log: a line printed before it, a warning, must not hide it)
            m = re.search(r" on http://\S+:(\d+) \(", self.log.read())
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"customops-run serve did not start: {self.tail}")
            time.sleep(0.1)
        self.port = int(m.group(1))

    @property
    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-1000:]

    def stop(self):
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    """Ends a server process: asked first, killed after a minute."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _LlamaServer:
    """llama.cpp's llama-server on a GGUF file, C slots of max_seq_len each."""

    def __init__(self, llama_cpp: Path, gguf: Path, slots: int, max_seq_len: int, device: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                    "--port", str(self.port), "--parallel", str(slots), "--ctx-size", str(slots * max_seq_len),
                    "--n-gpu-layers", "999" if device == "cuda" else "0", "--no-webui"]
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()  # (one that is still loading would hold its port and the GPU's memory)
                raise RuntimeError(f"llama-server did not start: {self.tail}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)

    def stop(self):
        _stop(self.proc)
        self.log.seek(0)
        self.tail = self.log.read()[-2000:]
        self.log.close()


def _gguf(model, tokenizer_json: Path, llama_cpp: Path, root: Path, outtype: str = "same") -> Path:
    """The model in llama.cpp's format, converted by llama.cpp's convert_hf_to_gguf.py to outtype
    ("same": the model's dtype; f16: as many bytes a weight as bf16, llama.cpp's CUDA kernels' oldest
    case, for a llama.cpp young at bf16). Its check of
    the BPE pre-tokenizer knows only published tokenizers' hashes; this one's is GPT-2's design
    (the prompts are ids, so only the vocabulary matters to the server)."""
    from transformers import PreTrainedTokenizerFast

    hf = root / "hf"
    model.save_pretrained(hf)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)).save_pretrained(hf)
    out = root / "model.gguf"
    dtype = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(next(model.parameters()).dtype, "f32")
    dtype = dtype if outtype == "same" else outtype
    convert = (f"import sys; sys.path[:0] = [{str(llama_cpp / 'gguf-py')!r}, {str(llama_cpp)!r}]\n"
               "import convert_hf_to_gguf as c\n"
               # (its model base class: conversion.base.TextModel since mid-2025, Model before)
               "try:\n    from conversion.base import TextModel\n"
               "except ImportError:\n    TextModel = getattr(c, 'TextModel', None) or c.Model\n"
               "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
               # its Llama tries a tokenizer.model first, importing sentencepiece (which a machine may
               # lack) before it finds none; there is none here
               "def no_sentencepiece(self, *args, **kwargs):\n"
               "    raise FileNotFoundError('no tokenizer.model')\n"
               "TextModel._set_vocab_sentencepiece = no_sentencepiece\n"
               f"sys.argv = ['convert_hf_to_gguf.py', {str(hf)!r}, '--outfile', {str(out)!r}, '--outtype', {dtype!r}]\n"
               "c.main()\n")
    r = subprocess.run([sys.executable, "-c", convert], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "NO_LOCAL_GGUF": ""})
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {r.stderr[-2000:]}")
    return out


def _stream(conn: http.client.HTTPConnection, prompt, new_tokens, extra=None) -> dict:
    """One streamed completion on a client's connection (kept alive between its requests, as
    OpenAI's clients keep theirs; http.client connects again where the server closed it): its TTFT,
    its token count and its chunks' arrival times."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra or {})})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    times, usage = [], None
    for raw in r:
        # (a server may send bytes that are no UTF-8: llama-server passes on a random model's lone
        # continuation bytes as they are)
        line = raw.decode(errors="replace")
        if not line.startswith("data: ") or line.startswith("data: [DONE]"):
            continue
        event = json.loads(line[6:])
        # a token's event: its text, or an empty one where the token ends mid-character (ids 0-255
        # of the bench's tokenizer are single bytes; a server may also send nothing until the
        # character is whole, and a stream of such tokens has no arrival times)
        if any(choice.get("text") or choice.get("finish_reason") is None for choice in event.get("choices") or ()):
            times.append(time.perf_counter())
        if event.get("usage"):
            usage = event["usage"]
    return {"start": t0, "times": times, "tokens": usage["completion_tokens"] if usage else len(times)}


# The server's own histograms of a request's first token (/metrics): its whole time, the wait for a
# slot and the prompt's prefill.
_FIRST_TOKEN = {"ttft": "customops_time_to_first_token_seconds", "queue": "customops_request_queue_time_seconds",
                "prefill": "customops_request_prefill_time_seconds"}


def _server_times(port) -> dict[str, tuple[float, int]]:
    """(sum of seconds, count) of each of _FIRST_TOKEN's histograms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for key, name in _FIRST_TOKEN.items():
        values = dict(re.findall(rf"^{name}_(sum|count) (\S+)$", text, re.M))
        out[key] = (float(values["sum"]), int(values["count"]))
    return out


def _complete(port, prompt, new_tokens, extra=None) -> str:
    """One greedy completion's text, not streamed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                                                        **(extra or {})}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
    return json.loads(body.decode(errors="replace"))["choices"][0]["text"]  # (as _stream_one's lines)


def _load(port, prompts, concurrency, requests, new_tokens, extra=None) -> dict:
    """concurrency clients, each sending requests streamed completions one after another (a
    sampling one, where extra samples, with a seed of its own)."""
    results, errors = [], []
    lock = threading.Lock()

    def client(k):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            for j in range(requests):
                try:
                    seeded = {**extra, "seed": k * requests + j} if extra and extra.get("temperature") else extra
                    res = _stream(conn, prompts[(k * requests + j) % len(prompts)], new_tokens, seeded)
                except Exception as e:  # noqa: BLE001
                    errors.append(str(e))
                    return
                with lock:
                    results.append(res)
        finally:
            conn.close()

    t = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if errors:
        raise RuntimeError(errors[0])
    # (a stream whose tokens never completed a character has no arrival times: its tokens count)
    timed = [r for r in results if r["times"]]
    if not timed:
        raise RuntimeError("no stream carried a token's event")
    ttft = [r["times"][0] - r["start"] for r in timed]
    itl = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in timed if r["tokens"] > 1] or [0.0]
    gaps = [b - a for r in timed for a, b in zip(r["times"], r["times"][1:])]

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]

    return {"tokens_per_s": sum(r["tokens"] for r in results) / wall, "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3, "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
            "max_gap_ms": max(gaps) * 1e3 if gaps else 0.0, "requests": len(results),
            "untimed_requests": len(results) - len(timed)}


def _sampling(args) -> dict:
    """The timed requests' sampling options (none: greedy)."""
    if not args.temperature:
        return {}
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def _generate(package, prompts, new_tokens, sampling=None) -> dict:
    cmd = [customops.runner_path(), "generate", package, "--max-new-tokens", str(new_tokens), "--ignore-eos"]
    for k, v in (sampling or {}).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    for p in prompts:
        cmd += ["--prompt", " ".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    prefill = float(re.search(r"prefill: \d+ tokens in ([\d.]+) ms", r.stderr).group(1))
    decode = float(re.search(r"steps of \d+ sequence\(s\) in ([\d.]+) ms \(([\d.]+) ms/token", r.stderr).group(1))
    per_token = float(re.search(r"\(([\d.]+) ms/token", r.stderr).group(1))
    return {"tokens_per_s": len(prompts) * new_tokens / ((prefill + decode) / 1e3), "decode_ms": per_token,
            "prefill_ms": prefill}


def _serve(package, tokenizer, c, env, prompts, args) -> tuple[dict, str]:
    """customops-run serve with --max-batch c under env: the load's report, and the greedy text of
    the first prompt's first 16 tokens."""
    server = _Server(package, tokenizer, c, env)
    try:
        _load(server.port, prompts[:c], c, 1, 8)  # warm-up: the batch sizes' CUDA graphs
        before = _server_times(server.port)
        result = _load(server.port, prompts, c, args.requests, args.new_tokens, _sampling(args))
        after = _server_times(server.port)
        # the server's own mean TTFT (submit to first id; what the client's adds is the HTTP path's
        # and the text's), and its parts: the wait for a slot, the prefill
        for key in _FIRST_TOKEN:
            (s0, n0), (s1, n1) = before[key], after[key]
            result[f"server_{key}_mean_ms"] = (s1 - s0) / max(n1 - n0, 1) * 1e3
        return result, _complete(server.port, prompts[0], 16)
    except Exception as e:
        exited = server.proc.poll()
        state = f"exited with {exited}" if exited is not None else "still running"
        raise RuntimeError(f"{e} (the server {state}; its last output: {server.tail[-400:]!r})") from e
    finally:
        server.stop()
        server.log.close()


def _llama(args, gguf, c, prompts) -> tuple[dict, str, str]:
    """llama-server with c slots under the same load as _serve (eos ignored, as the package has
    none): its report, its greedy text of the first prompt's first 16 tokens, its command line."""
    llama = _LlamaServer(args.llama_cpp, gguf, c, args.prompt_len + args.new_tokens + 8, args.device)
    try:
        extra = {"ignore_eos": True}
        _load(llama.port, prompts[:c], c, 1, 8, extra)
        result = _load(llama.port, prompts, c, args.requests, args.new_tokens, {**extra, **_sampling(args)})
        return result, _complete(llama.port, prompts[0], 16, extra), " ".join(llama.cmd[1:])
    finally:
        llama.stop()


def run(args) -> dict:
    model = _model(args)
    cfg = model.config
    levels = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp())
    _tokenizer_json(cfg.vocab_size, root / "tokenizer.json")
    t = time.perf_counter()
    package = str(customops.export.package_causal_lm(model, root / "llama.pt2", max_batch=max(levels),
                                                     max_seq_len=args.prompt_len + args.new_tokens))
    notes = [f"package_causal_lm: {time.perf_counter() - t:.0f} s (max_batch {max(levels)})"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    speed = _copy_speed(args.device)
    gguf = None
    if args.llama_cpp:
        t = time.perf_counter()
        gguf = _gguf(model, root / "tokenizer.json", args.llama_cpp, root, args.gguf_type)
        notes.append(f"convert_hf_to_gguf.py: {time.perf_counter() - t:.0f} s (GGUF weights: {args.gguf_type}); "
                     f"llama-server {_llama_version(args.llama_cpp)}")
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(2)
    rows = []
    for c in levels:
        n = max(c * args.requests, 1)
        lengths = prompt_lengths(args.prompt_len, args.same_length, n, g)
        prompts = [torch.randint(1, cfg.vocab_size, (k,), generator=g).tolist() for k in lengths]
        kv = 2 * cfg.num_hidden_layers * c * cfg.num_key_value_heads * cfg.head_dim * \
            (statistics.mean(lengths) + args.new_tokens / 2) * 2
        floor_ms = (weight_bytes + kv) / speed * 1e3
        if not args.no_progress:
            print(f"... concurrency {c}: customops-run generate, then serve", flush=True)
        row = {"concurrency": c, "floor_ms": floor_ms, "floor_tokens_per_s": c / floor_ms * 1e3}
        try:
            row["generate"] = _generate(package, prompts[:c], args.new_tokens, _sampling(args))
            if c == 1:  # the median of each prompt's prefill alone, as one client sends them
                row["prefill_alone_ms"] = statistics.median(_generate(package, [p], 1)["prefill_ms"] for p in prompts)
            else:  # the prefill of a prompt of the median length alone
                row["prefill_alone_ms"] = _generate(package, [sorted(prompts, key=len)[len(prompts) // 2]], 1)["prefill_ms"]
            row["serve"], text = _serve(package, root / "tokenizer.json", c, {}, prompts, args)
            for env in args.variant:
                try:
                    result, _ = _serve(package, root / "tokenizer.json", c, env, prompts, args)
                except Exception as e:  # noqa: BLE001  (a variant's failure is its own)
                    result = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row.setdefault("variants", {})[variant_label(env)] = result
        except Exception as e:  # noqa: BLE001  (reported; the other levels run)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if gguf is not None and "error" not in row:
            if not args.no_progress:
                print("    llama-server", flush=True)
            try:
                row["llama_server"], theirs, cmd = _llama(args, gguf, c, prompts)
                row["same_greedy_text"] = text == theirs
                # (numerics differ between the two, and a random model's greedy choices are close calls)
                row["greedy_common_chars"] = [len(os.path.commonprefix([text, theirs])), len(text), len(theirs)]
                if c == levels[0]:
                    notes.append(f"llama-server: {cmd}")
            except Exception as e:  # noqa: BLE001
                row["llama_server_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        rows.append(row)
        if not args.no_progress and "serve" in row:
            print(f"    serve {row['serve']['tokens_per_s']:,.0f} tokens/s, generate "
                  f"{row['generate']['tokens_per_s']:,.0f}", flush=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": versions(args.device),
            "layers": cfg.num_hidden_layers, "prompt_len": args.prompt_len, "same_length": args.same_length,
            "new_tokens": args.new_tokens, "requests": args.requests, "copy_gb_s": speed / 1e9,
            "sampling": _sampling(args),
            "variants": [variant_label(env) for env in args.variant]}
    return {"meta": meta, "rows": rows, "notes": notes}


def _llama_version(llama_cpp: Path) -> str:
    r = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-server"), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (\S+ \(\w+\))", r.stdout + r.stderr)
    return m.group(1) if m else "(version unknown)"


def prompt_lengths(longest: int, same_length: bool, n: int, g: torch.Generator) -> list[int]:
    """n prompts' lengths: a quarter to all of the longest at random, or all of it. (The same length
    lets a server's prefill shapes repeat, as generate's timed prefill repeats its warm-up's: it
    tells a shape's first-time costs from the rest of a server's time to first token.)"""
    if same_length:
        return [longest] * n
    return torch.randint(max(1, longest // 4), longest + 1, (n,), generator=g).tolist()


def _server_means(result: dict) -> tuple[float, ...]:
    """A serve run's own mean TTFT, wait for a slot and prefill (ms; NaN where the run has none)."""
    return tuple(result.get(f"server_{k}_mean_ms", float("nan")) for k in _FIRST_TOKEN)


def print_report(report: dict) -> None:
    m = report["meta"]
    print(f"{m['device']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    lengths = f"{m['prompt_len']}" if m.get("same_length") else f"{m['prompt_len'] // 4}-{m['prompt_len']}"
    sampling = ", ".join(f"{k} {v}" for k, v in m.get("sampling", {}).items())
    print(f"Llama {m['layers']} layers; prompts of {lengths} ids, {m['new_tokens']} "
          f"{'new tokens sampled (' + sampling + ')' if sampling else 'greedy new tokens'} each, {m['requests']} "
          "requests a client one after another")
    print(f"{'C':>3s} {'serve tok/s':>12s} {'generate':>9s} {'ratio':>6s} {'floor':>8s} {'TTFT p50/p99 ms':>17s} "
          f"{'in server':>9s} {'queue+prefill':>13s} {'prefill ms':>10s} {'ITL p50/p99 ms':>15s} "
          f"{'generate ms/tok':>15s} {'max gap ms':>10s}")
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['concurrency']:3d}  {r['error']}")
            continue
        s, g = r["serve"], r["generate"]
        ttft, queue, prefill = _server_means(s)
        print(f"{r['concurrency']:3d} {s['tokens_per_s']:12,.0f} {g['tokens_per_s']:9,.0f} "
              f"{s['tokens_per_s'] / g['tokens_per_s']:5.2f}x {r['floor_tokens_per_s']:8,.0f} "
              f"{s['ttft_p50_ms']:8.1f}/{s['ttft_p99_ms']:<8.1f} {ttft:9.1f} {queue:6.1f}+{prefill:<6.1f} "
              f"{r['prefill_alone_ms']:10.1f} "
              f"{s['itl_p50_ms']:7.2f}/{s['itl_p99_ms']:<7.2f} {g['decode_ms']:15.2f} {s['max_gap_ms']:10.1f}")
    print("ratio: serve's tokens/s over generate's for the same prompts at once; floor: C tokens per decode step "
          "at the copy speed; in server: the mean TTFT the server measures itself (/metrics: submit to first id), "
          "and its means of a request's wait for a slot and of its prefill (from its slot to its first id); "
          "prefill ms: the prefill of a prompt of the median length alone (customops-run generate; at one client, "
          "the median of each of its prompts alone)")
    for label in report["meta"]["variants"]:
        print(f"\n[{label}]\n{'C':>3s} {'serve tok/s':>12s} {'vs default':>10s} {'TTFT p50/p99 ms':>17s} "
              f"{'in server':>9s} {'queue+prefill':>13s} {'ITL p50/p99 ms':>15s} {'max gap ms':>10s}")
        for r in report["rows"]:
            if "error" in r.get("variants", {}).get(label, {}):
                print(f"{r['concurrency']:3d}  {r['variants'][label]['error']}")
            elif label in r.get("variants", {}) and "serve" in r:
                s, v = r["serve"], r["variants"][label]
                ttft, queue, prefill = _server_means(v)
                print(f"{r['concurrency']:3d} {v['tokens_per_s']:12,.0f} {v['tokens_per_s'] / s['tokens_per_s']:9.2f}x "
                      f"{v['ttft_p50_ms']:8.1f}/{v['ttft_p99_ms']:<8.1f} {ttft:9.1f} {queue:6.1f}+{prefill:<6.1f} "
                      f"{v['itl_p50_ms']:7.2f}/{v['itl_p99_ms']:<7.2f} {v['max_gap_ms']:10.1f}")
    if any("llama_server" in r or "llama_server_error" in r for r in report["rows"]):
        print(f"\n{'C':>3s} {'llama-server tok/s':>18s} {'serve/llama':>11s} {'TTFT p50/p99 ms':>17s} "
              f"{'ITL p50/p99 ms':>15s} {'max gap ms':>10s} {'greedy text agrees':>18s}")
        for r in report["rows"]:
            if "llama_server_error" in r:
                print(f"{r['concurrency']:3d}  {r['llama_server_error']}")
            if "llama_server" in r:
                s, ll = r["serve"], r["llama_server"]
                print(f"{r['concurrency']:3d} {ll['tokens_per_s']:18,.0f} {s['tokens_per_s'] / ll['tokens_per_s']:10.2f}x "
                      f"{ll['ttft_p50_ms']:8.1f}/{ll['ttft_p99_ms']:<8.1f} {ll['itl_p50_ms']:7.2f}/{ll['itl_p99_ms']:<7.2f} "
                      f"{ll['max_gap_ms']:10.1f} {_agreement(r):>18s}")
        print("greedy text agrees: the characters both servers' greedy text of the first prompt (16 tokens) "
              "starts with, of ours and of theirs")
    for n in report["notes"]:
        print(n)


def _agreement(row) -> str:
    if "greedy_common_chars" not in row:  # (a report of before the count)
        return "all" if row["same_greedy_text"] else "no"
    n, ours, theirs = row["greedy_common_chars"]
    return f"{n} of {ours}/{theirs}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m customops bench --serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, help="decoder layers (default: 16 on CUDA, 2 on CPU)")
    p.add_argument("--prompt-len", type=int, help="the longest prompt (default: 512 on CUDA, 32 on CPU)")
    p.add_argument("--same-length", action="store_true",
                   help="every prompt --prompt-len ids (default: a quarter to all of it at random)")
    p.add_argument("--new-tokens", type=int, help="default: 128 on CUDA, 16 on CPU")
    p.add_argument("--concurrency", help="comma-separated (default: 1,8,32 on CUDA, 1,2 on CPU)")
    p.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the timed requests sample at this temperature (default 0: greedy), as generate does")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature (default 0: every id)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1)")
    p.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="also serve with these environment variables set (repeatable)")
    p.add_argument("--llama-cpp", type=Path, metavar="DIR",
                   help="a llama.cpp checkout with build/bin/llama-server: runs it beside customops-run serve")
    p.add_argument("--gguf-type", choices=["same", "f16", "bf16", "f32"], default="same",
                   help="with --llama-cpp: its weights' type (default: the model's dtype; f16 has bf16's bytes "
                        "and is what an older llama.cpp's CUDA kernels do best)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _cli.require("python -m customops bench --serve", {"transformers": "hf", "tokenizers": "hf"})
    args.device = pick_device(p, args.device)
    if args.llama_cpp and not (args.llama_cpp / "build" / "bin" / "llama-server").is_file():
        p.error(f"--llama-cpp: no build/bin/llama-server in {args.llama_cpp}")
    cuda = args.device == "cuda"
    args.layers = args.layers or (16 if cuda else 2)
    args.prompt_len = args.prompt_len or (512 if cuda else 32)
    args.new_tokens = args.new_tokens or (128 if cuda else 16)
    args.concurrency = args.concurrency or ("1,8,32" if cuda else "1,2")
    report = run(args)
    print_report(report)
    write_json(args.json, report)
    failed = [r for r in report["rows"] if "error" in r or "llama_server_error" in r
              or any("error" in v for v in r.get("variants", {}).values())]
    return 1 if failed else 0
