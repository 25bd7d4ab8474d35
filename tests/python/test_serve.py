"""customops-run serve against the official openai client, on 127.0.0.1: a small Llama packaged with
4 slots, and a byte-level BPE tokenizer trained here with tokenizers (Llama-3's pre-tokenizer and
special tokens, bos put by its post-processor) saved by save_pretrained with Llama-3.1's real chat
template. Completions and chat, streaming and not, give Hugging Face's greedy generate on the same
text; concurrent clients, some cancelled mid-stream, each get their result alone; every bad request
gets OpenAI's error JSON with its status; the server stays healthy, and stops cleanly on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import customops

openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from conftest import DEVICES  # noqa: E402
from test_aoti import run  # noqa: E402

if "serve" not in run([customops.runner_path(), "--version"]).stdout:
    pytest.skip("customops-run was built without serve (Debian: libcpp-httplib-dev nlohmann-json3-dev pkg-config)",
                allow_module_level=True)

KEY, NAME, MAX_BATCH, MAX_SEQ_LEN, MAX_BODY = "test-key", "tiny-llama", 4, 160, 100_000
TEMPLATE = (Path(__file__).resolve().parent / "chat_templates" / "Llama-3.1-8B-Instruct.jinja").read_text()
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
TEXTS = ["The quick brown fox", "Once upon a time, in a land far away,", "café Straße 🙂 12345",
         "def f(x):\n    return x ** 2", "a", "Привет мир! こんにちは世界"]


def _hf_tokenizer(folder: Path):
    """A byte-level BPE tokenizer of Llama-3's design, saved by save_pretrained with Llama-3.1's chat
    template; returns transformers' tokenizer read back from the folder."""
    from test_tokenizer import LLAMA3, _corpus
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(300, seed=0) + TEXTS * 5, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|eot_id|>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=DEVICES)
def served(request, tmp_path_factory):
    """(server, Hugging Face model, tokenizer): customops-run serve on a free port of 127.0.0.1. The
    model is float32 (test_engine says why); on CUDA the greedy ids to match are the package's own
    (customops-run generate of one prompt), where they are Hugging Face's on the CPU."""
    import causal_lms

    root = tmp_path_factory.mktemp("serve")
    hf_tok = _hf_tokenizer(root / "tokenizer")
    ids = hf_tok.convert_tokens_to_ids
    model = causal_lms.llama(vocab_size=len(hf_tok), hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             bos_token_id=ids("<|begin_of_text|>"), eos_token_id=ids("<|eot_id|>"))
    model.generation_config.bos_token_id = ids("<|begin_of_text|>")
    model.generation_config.eos_token_id = ids("<|eot_id|>")
    model = model.to(request.param)
    # the package embeds the tokenizer (test_the_package_s_own_tokenizer_serves); this server is
    # given the folder
    path = customops.export.package_causal_lm(model, root / f"{NAME}.pt2", max_batch=MAX_BATCH,
                                              max_seq_len=MAX_SEQ_LEN, tokenizer=hf_tok)
    server = Server(path, root / "tokenizer", "--api-key", KEY, "--max-body", str(MAX_BODY), "--token-budget", "64")
    server.package, server.device = path, request.param
    yield server, model, hf_tok
    server.stop()


class Server:
    def __init__(self, package, tokenizer, *args, env=None):
        """tokenizer None: the one the package embeds; env: variables added to this process's."""
        given = [] if tokenizer is None else ["--tokenizer", tokenizer]
        self.proc = subprocess.Popen([customops.runner_path(), "serve", package, *given, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env} if env else None)
        self.startup: list[str] = []  # the lines before the one that says where it listens
        while True:
            line = self.proc.stderr.readline()
            m = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
            if m or not line:
                break
            self.startup.append(line)
        assert m, "".join(self.startup) + line + self.proc.stderr.read()
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.stderr: list[str] = []  # (whole once the process ended and self.reader was joined)
        self.reader = threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def http(self, method, path, body=None, headers=None, key=True):
        """(status, body as JSON or text) of a raw request."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {KEY}"} if key else {}), **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def metrics(self) -> dict[str, float]:
        """One scrape of /metrics: each sample's value by its name (labels included)."""
        _, text = self.http("GET", "/metrics")
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.M)}

    def metric(self, name):
        return self.metrics()[name]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=30)
        return self.proc.returncode


def greedy_ids(server, model, ids, n):
    """The greedy continuation of ids alone: Hugging Face's generate on the CPU, customops-run
    generate of the one prompt on CUDA."""
    from causal_lms import generate, hf_generate

    if server.device == "cpu":
        return hf_generate(model, ids, n)
    r = generate(server.package, "--max-new-tokens", str(n), "--prompt", " ".join(map(str, ids)))
    assert r.returncode == 0, r.stderr
    return list(map(int, r.stdout.split()))


def greedy_text(server, model, hf_tok, ids, n):
    """greedy_ids' text (special tokens left out) and length."""
    new = greedy_ids(server, model, ids, n)
    return hf_tok.decode(new, skip_special_tokens=True), len(new)


def chat_ids(hf_tok, messages):
    return hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_completions_are_hugging_face_greedy_generate(served):
    server, model, hf_tok = served
    client = server.client()
    for text in TEXTS:
        want, n = greedy_text(server, model, hf_tok, hf_tok(text).input_ids, 12)
        r = client.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0)
        assert r.choices[0].text == want, text
        assert r.choices[0].finish_reason == ("length" if n == 12 else "stop")
        assert r.usage.prompt_tokens == len(hf_tok(text).input_ids) and r.usage.completion_tokens == n
        assert r.model == NAME and r.object == "text_completion"
        chunks = list(client.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == n


def test_chat_renders_the_template_and_is_hugging_face_greedy_generate(served):
    server, model, hf_tok = served
    client = server.client()
    conversations = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 🙂"},
         {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And then?"}],
    ]
    for messages in conversations:
        ids = chat_ids(hf_tok, messages)
        want, n = greedy_text(server, model, hf_tok, ids, 10)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_cut_the_text_before_them(served):
    """The text ends before the first stop string, and usage counts the ids up to the one that
    completed it, however many more the engine sampled before the request was cancelled (an update
    can bring many ids at once)."""
    server, model, hf_tok = served
    client = server.client()
    # a prompt whose greedy text has two characters mid-way to stop at (a random model's text may be
    # lone bytes, U+FFFD: the stream holds those until 3 more ids show that no id completes them,
    # which the count of ids up to the stop string would then include)
    for text in TEXTS[1:] + TEXTS[:1]:
        ids = greedy_ids(server, model, hf_tok(text).input_ids, 16)
        full = hf_tok.decode(ids, skip_special_tokens=True)
        stop = full[len(full) // 2:len(full) // 2 + 2]
        if len(stop) == 2 and stop.strip() and "\ufffd" not in full[:len(full) // 2 + 2]:
            break
    else:
        pytest.fail("no prompt's greedy text has a stop string of whole characters")
    want = full[:full.index(stop)]
    upto = next(m for m in range(1, len(ids) + 1) if stop in hf_tok.decode(ids[:m], skip_special_tokens=True))
    for _ in range(4):
        r = client.completions.create(model=NAME, prompt=text, max_tokens=64, temperature=0, stop=[stop, "never here"])
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        assert r.usage.completion_tokens == upto
    chunks = list(client.completions.create(model=NAME, prompt=text, max_tokens=64, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == upto
    # two stop strings, one inside the other's text: the text ends where the first one found starts
    # (where both complete with the same id, the one that starts first; llama-server cuts so too)
    inner = stop[1:]
    both = full[:min(full.index(stop), full.index(inner))]
    r = client.completions.create(model=NAME, prompt=text, max_tokens=16, temperature=0, stop=[stop, inner])
    assert r.choices[0].text == both


def test_seeded_sampling_repeats(served):
    server, _, _ = served
    client = server.client()
    args = dict(model=NAME, prompt=TEXTS[0], max_tokens=12, temperature=1.5, top_p=0.95, extra_body={"top_k": 50})
    a, b, c = (client.completions.create(seed=s, **args).choices[0].text for s in (3, 3, 4))
    assert a == b and a != c


def test_concurrent_clients_each_get_their_result_alone(served):
    """Twelve clients at once on four slots, prompts of different lengths, half streaming; three
    streams are dropped after their first chunks. Every finished one is its result alone, and once
    all are done no slot stays taken."""
    server, model, hf_tok = served
    prompts = [TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(12)]
    wants = [greedy_text(server, model, hf_tok, hf_tok(p).input_ids, 8 + i % 5)[0] for i, p in enumerate(prompts)]

    def one(i):
        client = server.client()
        args = dict(model=NAME, prompt=prompts[i], max_tokens=8 + i % 5, temperature=0)
        if i % 2 == 0:
            return client.completions.create(**args).choices[0].text
        stream = client.completions.create(stream=True, **args)
        if i % 4 == 1:  # a client that goes away after its first chunk
            next(iter(stream))
            stream.close()
            return None
        return "".join(c.choices[0].text for c in stream)

    # meanwhile every scrape agrees with itself: a request counted ended holds no slot and is not
    # waiting, one not counted accepted is in neither (no stop strings here: those count as ended a
    # step before their slots are free)
    done, scrapes = threading.Event(), []

    def scrape():
        while not done.is_set():
            m = server.metrics()
            ended = sum(v for k, v in m.items() if k.startswith("customops_requests_finished_total"))
            scrapes.append((m["customops_requests_running"] + m["customops_requests_waiting"],
                            m["customops_requests_total"] - ended))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(one, range(12)))
    finally:
        done.set()
        scraper.join()
    assert scrapes and all(gauged <= in_flight for gauged, in_flight in scrapes), [s for s in scrapes if s[0] > s[1]]
    for i, text in enumerate(got):
        if i % 4 != 1:
            assert text == wants[i], i
    deadline = time.time() + 30
    while server.metric("customops_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("customops_requests_running") == 0 and server.metric("customops_requests_waiting") == 0
    assert server.http("GET", "/health") == (200, {"status": "ok"})


def _long_prompt(server, model, hf_tok, n):
    """A prompt whose greedy continuation runs the whole n ids (no eos), so that finishing it would show."""
    prompt = next((t for t in TEXTS if greedy_text(server, model, hf_tok, hf_tok(t).input_ids, n)[1] == n), None)
    if prompt is None:
        pytest.skip("every prompt's greedy continuation ends at eos before max_tokens")
    return prompt


def _ends(server):
    scrape = server.metrics()
    return {r: scrape[f'customops_requests_finished_total{{reason="{r}"}}'] for r in ("stop", "length", "cancelled")}


def _wait_for_an_end(server, before):
    """Waits (30 s at most) for the request in flight to end; how the ends changed since before. (The
    server counts an end once its slot is free: running, read after, is 0.)"""
    deadline = time.time() + 30
    while sum((after := _ends(server)).values()) == sum(before.values()) and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("customops_requests_running") == 0
    return {r: after[r] - before[r] for r in before}


def _wait_for_a_cancel(server, before, tokens, n):
    """Waits for the request in flight to end as cancelled; checks it ended short of n ids."""
    assert _wait_for_an_end(server, before) == {"stop": 0, "length": 0, "cancelled": 1}
    assert server.metric("customops_generated_tokens_total") - tokens < n
    assert server.http("GET", "/health") == (200, {"status": "ok"})


def test_a_dropped_stream_is_cancelled_not_finished(served):
    """A client that closes a long stream after its first chunk ends its request: the server sees
    the closed connection at its next write, cancels the request (counted as cancelled, not
    length) and frees its slot, short of the max_tokens it asked for."""
    server, model, hf_tok = served
    n = MAX_SEQ_LEN - 40
    prompt = _long_prompt(server, model, hf_tok, n)
    for _ in range(3):  # (a client stalled longer than the whole answer saw it end: once more)
        before, tokens = _ends(server), server.metric("customops_generated_tokens_total")
        # a raw connection, closed as soon as the first event arrives (no client library between)
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(dict(model=NAME, prompt=prompt, max_tokens=n,
                                                                 temperature=0, stream=True)),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        ends = _wait_for_an_end(server, before)
        if ends["length"] == 0:
            break
    assert ends == {"stop": 0, "length": 0, "cancelled": 1}
    assert 1 <= server.metric("customops_generated_tokens_total") - tokens < n
    assert server.http("GET", "/health") == (200, {"status": "ok"})


def test_a_client_that_leaves_before_its_whole_answer_cancels_it(served):
    """A request without stream writes nothing until its end, and cpp-httplib 0.11 tells its handler
    nothing of the connection: the server watches the connection's socket itself, so a client that
    closes it (a timeout, a user's ^C) cancels its request at the engine's next step instead of
    holding a slot to max_tokens. Bytes the client sent after its request (here a stray line end)
    and nobody read do not hide the close."""
    server, model, hf_tok = served
    n = MAX_SEQ_LEN - 40
    prompt = _long_prompt(server, model, hf_tok, n)
    body = json.dumps(dict(model=NAME, prompt=prompt, max_tokens=n, temperature=0)).encode()
    for after in (b"", b"\r\n"):
        before, tokens = _ends(server), server.metric("customops_generated_tokens_total")
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) +
                      body + after)
        _wait_for_a_cancel(server, before, tokens, n)


@pytest.mark.parametrize("path,body,status,match", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"model": NAME}, 400, "prompt is required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt must be a string"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature must be a number"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, 400, r"temperature must be in \[0, 2\]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be greater than 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.0000001}, 400, r"top_p must be in \[0, 1\], not 1\.0000001$"),
    ("/v1/completions", {"prompt": [1, 2**63]}, 400, r"prompt holds an id past any vocabulary \(9223372036854775808\)"),
    ("/detokenize", {"tokens": [2**64 - 1]}, 400, "tokens holds an id past any vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop must be a string"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n is not supported"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/completions", {"prompt": "hi " * 400}, 400, f"more than the package's max_seq_len \\({MAX_SEQ_LEN}\\)"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 400, "'gpt-4' is not served here"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "role 'tool' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "content must be a string"),
    ("/v1/nowhere", {}, 404, "no such endpoint"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 40_000 + b"]" * 40_000 + b"}", 400, "deeper than 32 levels"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": 1}}, 400, "response_format is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": 5, "text": "x"}]}]}, 400,
     "only text content parts"),
])
def test_a_bad_request_gets_openai_error_json(served, path, body, status, match):
    server, _, _ = served
    got, out = server.http("POST", path, body)
    assert got == status and isinstance(out, dict), (got, out)
    assert set(out["error"]) == {"message", "type", "param", "code"} and re.search(match, out["error"]["message"]), out
    if path == "/v1/completions" and re.search("prompt|vocabulary|max_seq_len", match):
        assert out["error"]["param"] == "prompt", out  # (named as OpenAI names it)
    if "max_seq_len" in match:
        assert out["error"]["code"] == "context_length_exceeded", out


def test_a_chat_longer_than_the_cache_names_its_messages(served):
    server, _, _ = served
    got, out = server.http("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}]})
    assert got == 400 and out["error"]["param"] == "messages", out
    assert out["error"]["code"] == "context_length_exceeded" and "max_seq_len" in out["error"]["message"], out


def test_the_api_key_and_the_body_limit(served):
    server, _, _ = served
    status, out = server.http("POST", "/v1/completions", {"prompt": "hi"}, key=False)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert server.http("POST", "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "Bearer no"})[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    status, out = server.http("POST", "/v1/completions", {"prompt": "x" * (MAX_BODY + 10)})
    assert status == 413 and "larger than" in out["error"]["message"]
    assert server.http("GET", "/health", key=False) == (200, {"status": "ok"})  # open, as llama-server's
    # bodies httplib would not bound by --max-body: chunked, or compressed, or another method's (it
    # reads a PUT's body before it finds no route); refused unread, the connection closed
    port = int(server.url.rsplit(":", 1)[1])
    for method, headers, status in (("POST", {"Transfer-Encoding": "chunked"}, 411),
                                    ("POST", {"Content-Encoding": "gzip"}, 415),
                                    ("PUT", {"Transfer-Encoding": "chunked"}, 405), ("DELETE", {}, 405)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = b"2\r\n{}\r\n0\r\n\r\n" if "Transfer-Encoding" in headers else b"{}"
        conn.request(method, "/v1/completions", body, {"Authorization": f"Bearer {KEY}", **headers})
        r = conn.getresponse()
        assert r.status == status and "error" in json.loads(r.read()), (method, headers)
        assert r.getheader("Connection") == "close", r.getheaders()
        if status == 405:
            assert r.getheader("Allow") == "GET, HEAD, POST"
        conn.close()
    # a length over the limit is refused at once (httplib would wait for that body to skip it); two
    # lengths, one that is not a count, or a header name with white space (which httplib keeps as
    # another header) are refused: a proxy in front may read them otherwise
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for lines, status in (([b"Content-Length: %d" % (MAX_BODY + 1)], 413), ([b"Content-Length: " + b"9" * 30], 413),
                          ([b"Content-Length: %d" % len(body), b"Content-Length: 5"], 400),
                          ([b"Content-Length: -5"], 400), ([b"Content-Length: 5", b"Transfer-Encoding : chunked"], 400),
                          ([b"Content-Length: %d" % len(body), b"Content-Encoding: identity"], 200)):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            start = time.monotonic()
            s.sendall(b"\r\n".join([b"POST /v1/completions HTTP/1.1", b"Host: x", b"Authorization: Bearer " + KEY.encode(),
                                     *lines, b"", body if status == 200 else b""]))
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 %d " % status), (lines, answer)
        assert time.monotonic() - start < 2, lines  # (httplib's read timeout is 5 s)
    assert server.http("GET", "/health", key=False) == (200, {"status": "ok"})
    with pytest.raises(openai.BadRequestError, match="not served here"):
        server.client().completions.create(model="other", prompt="hi", max_tokens=2)


def test_models_tokenize_detokenize_and_metrics(served):
    server, _, hf_tok = served
    assert [m.id for m in server.client().models.list()] == [NAME]
    text = TEXTS[2]
    status, out = server.http("POST", "/tokenize", {"content": text})
    assert status == 200 and out["tokens"] == hf_tok(text, add_special_tokens=False).input_ids
    assert server.http("POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"] == hf_tok(text).input_ids
    assert server.http("POST", "/detokenize", {"tokens": out["tokens"]}) == (200, {"content": text})
    server.client().completions.create(model=NAME, prompt=text, max_tokens=2, temperature=0)  # (one at least)
    _, metrics = server.http("GET", "/metrics")
    for name in ("customops_requests_total", "customops_prompt_tokens_total", "customops_generated_tokens_total",
                 "customops_requests_running", "customops_requests_waiting", "customops_steps_total",
                 "customops_runs_total", "customops_computed_tokens_total", "customops_requests_finished_total",
                 "customops_time_to_first_token_seconds_count", "customops_inter_token_latency_seconds_bucket",
                 "customops_request_queue_time_seconds_bucket", "customops_request_prefill_time_seconds_bucket"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? \d", metrics, re.M), name
    assert server.metric("customops_requests_total") > 0
    # every first token splits into the wait for a slot and the prompt's prefill (one reading of /metrics)
    def value(name):
        return float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))

    ttft = value("customops_time_to_first_token_seconds_count")
    assert ttft > 0
    assert value("customops_request_queue_time_seconds_count") == ttft
    assert value("customops_request_prefill_time_seconds_count") == ttft
    assert value("customops_request_prefill_time_seconds_sum") > 0
    assert value("customops_request_queue_time_seconds_sum") >= 0


def test_the_package_s_own_tokenizer_serves(served, tmp_path):
    """A package that embeds its tokenizer (package_causal_lm(..., tokenizer=...)) serves without
    --tokenizer: the same chat template, text and ids as the folder's. This server also pads its
    prompt chunks to multiples of 8 and runs those shapes at startup (--prefill-multiple, 64 on CUDA
    by default, 1 on the CPU): the greedy text is the same. A multiple below 1 is refused. The
    tokenizer's files, unpacked into TMPDIR while the server runs, are gone when it has stopped (on
    CUDA the removal once crashed at exit)."""
    server, _, hf_tok = served
    bad = run([customops.runner_path(), "serve", server.package, "--prefill-multiple", "0"])
    assert bad.returncode == 2 and "--prefill-multiple" in bad.stderr, bad.stderr
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    own = Server(server.package, None, "--api-key", KEY, "--prefill-multiple", "8", env={"TMPDIR": str(tmp)})
    assert any(p.name.startswith("customops-tokenizer-") for p in tmp.iterdir()), list(tmp.iterdir())
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
        got, want = (s.client().chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
                     for s in (own, server))
        assert got.choices[0].message.content == want.choices[0].message.content
        text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(hf_tok(text, add_special_tokens=False).input_ids)
        assert own.http("POST", "/tokenize", {"content": TEXTS[5]})[1]["tokens"] == hf_tok(
            TEXTS[5], add_special_tokens=False).input_ids
    finally:
        assert own.stop() == 0
    assert list(tmp.iterdir()) == []
    r = run([customops.runner_path(), server.package, "--info"])
    assert re.search(r"^tokenizer: .*tokenizer\.json.*tokenizer_config\.json", r.stdout, re.M), r.stdout
    # generate --text: the package's tokenizer in and out, as the folder's
    outs = [run([customops.runner_path(), "generate", server.package, *how, "--prompt", TEXTS[0], "--max-new-tokens",
                 "4", "--ignore-eos"], env={"TMPDIR": tmp}) for how in (["--text"], ["--tokenizer", server.proc.args[4]])]
    assert all(r.returncode == 0 for r in outs) and outs[0].stdout == outs[1].stdout != "", outs
    assert list(tmp.iterdir()) == []


def test_sigterm_stops_the_server_cleanly(served, tmp_path):
    server, _, _ = served
    other = Server(server.package, server.proc.args[4])
    assert other.http("GET", "/health")[0] == 200
    stream = other.client().completions.create(model=NAME, prompt="hi", max_tokens=100, stream=True)
    next(iter(stream))
    assert other.stop() == 0
    other.reader.join(30)
    assert any("stopped" in line for line in other.stderr), other.stderr


def _empty_soon(folder, seconds=10):
    """Whether folder is empty within seconds (what a stopped process made is removed by its child,
    once it is gone)."""
    deadline = time.monotonic() + seconds
    while any(folder.iterdir()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _has_an_entry(folder) -> bool:
    try:
        return any(folder.iterdir())
    except FileNotFoundError:  # (removed as it was looked at)
        return False


def _stopped_while_unpacking(cmd, sig, tmp) -> tuple[int, str]:
    """cmd run with TMPDIR=tmp and sent sig once its unpacked copy of the package has a file (or,
    where that moment passes unseen, at most 50 ms after its folder is made): its exit status and
    stderr."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline, made = time.monotonic() + 60, None
        # (torch's loader unpacking the package into customops-run-XXXXXX; on an H200 a tiny
        # package's whole generate once ran between two looks for a file, 2026-11-29)
        while True:
            folders = [p for p in tmp.iterdir() if p.name.startswith("customops-run-")]
            if any(_has_an_entry(p) for p in folders):
                break
            if folders and made is None:
                made = time.monotonic()
            if made is not None and time.monotonic() > made + 0.05:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        proc.send_signal(sig)
        return proc.wait(timeout=30), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_signal_while_loading_stops_the_server_at_once(served, tmp_path):
    """SIGTERM or SIGINT while the package loads (minutes for a large model, not interruptible)
    ends the server at once, as the signal does, the package's unpacked copy and its tokenizer's
    folder removed, instead of after the load and warm-up."""
    server, _, _ = served
    for sig in (signal.SIGTERM, signal.SIGINT):
        (tmp := tmp_path / sig.name).mkdir()
        rc, err = _stopped_while_unpacking([customops.runner_path(), "serve", server.package, "--port", "0"], sig, tmp)
        assert rc == -sig, err
        assert f"customops-run serve: stopped before serving ({sig.name})" in err and "on http://" not in err, err
        assert _empty_soon(tmp), list(tmp.iterdir())


def test_a_signal_ends_generate_at_once_leaving_no_folder(served, tmp_path):
    """SIGINT or SIGTERM during customops-run generate ends it at once, as the signal does (a shell
    loop over it stops at Ctrl-C), the package's unpacked copy and its tokenizer's folder removed
    (both are in TMPDIR while it runs: a large model's unpacked copy is gigabytes)."""
    server, _, _ = served
    for sig in (signal.SIGINT, signal.SIGTERM):
        (tmp := tmp_path / sig.name).mkdir()
        rc, err = _stopped_while_unpacking([customops.runner_path(), "generate", server.package, "--text", "--prompt",
                                            "hi", "--max-new-tokens", "8", "--ignore-eos"], sig, tmp)
        assert rc == -sig, err
        assert f"customops-run generate: interrupted ({sig.name})" in err, err
        assert _empty_soon(tmp), list(tmp.iterdir())


def test_a_crash_reports_its_signal_and_stack(served):
    """A crash (here a SIGSEGV sent from outside) writes which signal it was and the stack to stderr,
    then ends the process as that signal does: what a bug report from a server needs."""
    server, _, _ = served
    other = Server(server.package, server.proc.args[4])
    other.proc.send_signal(signal.SIGSEGV)
    assert other.proc.wait(timeout=30) == -signal.SIGSEGV
    other.reader.join(30)
    text = "".join(other.stderr)
    assert "customops-run: crashed (SIGSEGV); please report it with this stack:" in text, text
    assert re.search(r"customops-run\(\+0x[0-9a-f]+\)\[0x[0-9a-f]+\]", text), text  # (addr2line's input)
    assert "the program counter was" not in text, text  # (its stack is whole: no scan)


def test_random_request_bodies_get_an_answer_or_a_400_never_a_crash(served):
    """400 request bodies whose fields are drawn at random (every JSON type, edge numbers, huge
    and negative values, strings of special tokens, deep nesting), some of them valid: each gets
    200 or a 400 with OpenAI's error JSON, and the server stays healthy."""
    import random

    server, _, _ = served
    rng = random.Random(0)
    values = [None, True, False, 0, 1, -1, 2, 7, 2**31, 2**63 - 1, 2**64, -2**63, 0.5, 1e308, -1e-300, "", "hi",
              "<|eot_id|><|begin_of_text|>", "\x00\u2028🙂", [], [1, 2], ["a", "b"], [[1]], {}, {"a": 1},
              {"include_usage": True}, [1] * 5000, {"a": {"b": {"c": [None]}}}]
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "seed", "stop", "stream", "stream_options", "n", "logprobs", "echo", "presence_penalty", "logit_bias",
              "chat_template_kwargs", "user"]
    message = [{"role": "user", "content": "hi"}]
    for i in range(400):
        chat = i % 2 == 1
        body = {"prompt": "hi"} if not chat else {"messages": message}
        for f in rng.sample(fields, rng.randint(1, 4)):
            body[f] = rng.choice(values + ([message, [{"role": rng.choice(["user", "x", 3]), "content": rng.choice(values)}]]
                                          if f == "messages" else []))
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
            body["max_tokens"] = 4
        status, out = server.http("POST", "/v1/chat/completions" if chat else "/v1/completions", body)
        assert status in (200, 400), (status, body, out)
        if status == 400:
            assert isinstance(out, dict) and out["error"]["message"], (body, out)
    assert server.http("GET", "/health") == (200, {"status": "ok"})
