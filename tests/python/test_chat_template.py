"""customops::ChatTemplate against transformers' apply_chat_template(..., tokenize=False): the real chat
templates of Llama-3.x, Mistral (7B v0.3, Nemo), Qwen2.5 and Qwen3 (tests/python/chat_templates) render
hundreds of random conversations byte for byte as transformers does (system or not, 1-4 turns, with and
without the generation prompt, contents with edge whitespace, unicode, Jinja-looking text, think tags);
a template exercising the rest of the implemented Jinja subset does too; where the template raises
(Mistral's alternating roles), both raise the same message; templates using Jinja outside the subset
are refused with one sentence. Through the consumer program chat_template_api (C++ API)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")

from test_aoti import run  # noqa: E402

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
LLAMA3, MISTRAL, QWEN = ("<|begin_of_text|>", "<|eot_id|>"), ("<s>", "</s>"), (None, "<|im_end|>")  # (bos, eos)
TOKENS = {"Llama-3.1-8B-Instruct": LLAMA3, "Llama-3.2-3B-Instruct": LLAMA3, "Llama-3.3-70B-Instruct": LLAMA3,
          "Mistral-7B-Instruct-v0.3": MISTRAL, "Mistral-Nemo-Instruct-2407": MISTRAL,
          "Qwen2.5-7B-Instruct": QWEN, "Qwen3-0.6B": QWEN}

PIECES = ["Hello!", "", " ", "  leading and trailing  ", "\n\nnewlines\n", "line one\nline two", "tab\there\t",
          "café, Straße, Привет, こんにちは, 🙂👍🏽", "\u00a0no-break and ideographic\u3000", "\u2028\u2003",
          "{{ x }}", "{% if true %}yes{% endif %}", "{# not a comment #}", "raise_exception('no')",
          "<|eot_id|><|im_end|></s>[INST]", "quotes ' \" and \\ backslash \\n", "<think>\nreasoning\n</think>\n\nanswer",
          "</think>only the end", "<think>unclosed", "<tool_response>\nresult\n</tool_response>", "\r\nwindows\r\n",
          "a" * 300]
SEPARATORS = ["", " ", "\n", "\n\n", "  \t"]


def _tokenizer(template, bos, eos):
    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(t for t in (bos, eos) if t)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="[UNK]")
    out.chat_template = template
    return out


def _content(rng):
    parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 3))]
    return "".join(p + rng.choice(SEPARATORS) for p in parts[:-1]) + parts[-1]


def _conversation(rng):
    """System or not, 0-3 user/assistant pairs, then a user turn (or, at times, none)."""
    messages = [{"role": "system", "content": _content(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 3)):
        messages += [{"role": "user", "content": _content(rng)}, {"role": "assistant", "content": _content(rng)}]
    if not messages or messages[-1]["role"] != "assistant" or rng.random() < 0.8:
        messages.append({"role": "user", "content": _content(rng)})
    return messages


def _case(messages, generation_prompt, extra):
    fields = [f"{m['role'].encode().hex()}:{m['content'].encode().hex()}" for m in messages]
    fields += [f"@{k.encode().hex()}:{str(v).lower().encode().hex()}" for k, v in extra.items()]
    return "\t".join(["G" if generation_prompt else "-", *fields])


def _expected(tok, messages, generation_prompt, extra):
    """("ok", prompt) or ("error", message) where the template raised (message only for raise_exception)."""
    try:
        return "ok", tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)
    except jinja2.TemplateError as e:
        return "error", None if isinstance(e, jinja2.UndefinedError) else str(e)
    except (TypeError, ValueError):
        return "error", None


def _render(consumer, template, bos, eos, cases, tmp_path):
    path, cases_path = tmp_path / "template.jinja", tmp_path / "cases.txt"
    path.write_bytes(template.encode())
    cases_path.write_text("".join(c + "\n" for c in cases))
    r = run([consumer / "chat_template_api", path, bos or "", eos or "", cases_path])
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _compare(consumer, template, bos, eos, conversations, tmp_path):
    """Renders (messages, generation_prompt, extra) triples both ways; returns the number compared."""
    tok = _tokenizer(template, bos, eos)
    got = _render(consumer, template, bos, eos, [_case(*c) for c in conversations], tmp_path)
    assert len(got) == len(conversations), got[:3]
    for (messages, generation_prompt, extra), line in zip(conversations, got):
        kind, want = _expected(tok, messages, generation_prompt, extra)
        where = f"messages={messages!r} add_generation_prompt={generation_prompt} extra={extra}"
        if kind == "ok":
            assert line.startswith("ok "), f"{where}: {line}"
            assert bytes.fromhex(line[3:]).decode() == want, where
        else:
            assert line.startswith("error "), f"{where}: transformers raised, we rendered"
            if want is not None:
                assert line == f"error {want}", where
    return len(conversations)


def test_fixtures_are_known():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(TOKENS)


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_real_templates_render_as_transformers(name, consumer, tmp_path):
    rng = random.Random(f"chat-{name}")
    thinking = [{}, {"enable_thinking": False}, {"enable_thinking": True}] if name.startswith("Qwen3") else [{}]
    conversations = [(_conversation(rng), rng.random() < 0.5, rng.choice(thinking)) for _ in range(400)]
    assert _compare(consumer, (TEMPLATES / f"{name}.jinja").read_text(), *TOKENS[name], conversations, tmp_path) == 400


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_any_roles_render_or_raise_as_transformers(name, consumer, tmp_path):
    """Roles in any order (Mistral raises on these), and an empty conversation (transformers refuses it)."""
    rng = random.Random(f"roles-{name}")
    conversations = [([], True, {})]
    for _ in range(150):
        roles = [rng.choice(["system", "user", "assistant"]) for _ in range(rng.randint(1, 5))]
        conversations.append(([{"role": r, "content": _content(rng)} for r in roles], rng.random() < 0.5, {}))
    _compare(consumer, (TEMPLATES / f"{name}.jinja").read_text(), *TOKENS[name], conversations, tmp_path)


def test_mistral_raises_on_roles_that_do_not_alternate(consumer, tmp_path):
    template = (TEMPLATES / "Mistral-7B-Instruct-v0.3.jinja").read_text()
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    got = _render(consumer, template, *MISTRAL, [_case(messages, True, {})], tmp_path)
    with pytest.raises(jinja2.TemplateError, match="must alternate") as e:
        _tokenizer(template, *MISTRAL).apply_chat_template(messages, tokenize=False)
    assert got == [f"error {e.value}"]


# The rest of the subset: scoping, loops, namespaces, filters, tests, string methods, slices, whitespace control.
CONSTRUCTS = """{#- everything the real templates use, and a little more -#}
{%- set ns = namespace(count=0, roles='') %}
{%- for m in messages if m.role != 'system' %}
    {%- set ns.count = ns.count + 1 %}
    {%- set ns.roles = ns.roles ~ m.role[0] %}
    {%- set leaked = 'no' %}
{%- endfor %}
count={{ ns.count }} roles={{ ns.roles }} n={{ messages|length }} {{ leaked is defined }} {{ (messages|last).role }}
{% for m in messages[::-1] %}
  {{- loop.index }}/{{ loop.length }}{{ ' first' if loop.first }}{{ ' last' if loop.last else '' }} {{ loop.revindex0 }}
  {%- if loop.previtem is defined %} after {{ loop.previtem.role }}{% endif %}:
  {%- if m.content is string and m.content|trim|length > 0 %} [{{ m.content|trim }}] {{ m.content[:3] }}|{{ m.content[-2:] }}
    {{- m.content[1:-1:2] }}|{{ m.content[::-1] }}|{{ m.content[-1] }}|{{ m.content[2:1] }}|{{ m.content[5:-40:-3] }}
  {%- elif m.content == '' %} empty
  {%- else %} blank({{ m.content|length }})
  {%- endif %}
  {{- ' S' if m.content.startswith('<') }}{{ ' E' if m.content.endswith('>') }} {{ m.content.split('\\n')|length }}
  {{- m.content.split()|join('_') }} {{ m.content.split(None, 1)|join('^') }} {{ m.content.split('a', 2)|join('^') }}
  {{- m.content.strip('\\n ') }}|{{ m.content.lstrip() }}|{{ m.content.rstrip() }}|{{ m.content.replace('a', 'A', 2) }}
  {{- m.content|tojson }} {{ m|tojson }} {{ m.items()|list|length }} {{ 'think' in m.content }} {{ 'x' not in m }}
  {{- m.role.upper() }}{{ m.role|lower }} {{ m.get('role') }}{{ m.get('nothing', 'default') }}{{ m['missing'] is defined }}
{% else %}
none
{% endfor %}
{{- messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|join(',') }}
{{ messages|map(attribute='role')|reject('equalto', 'system')|join('+') }} {{ (messages|length) % 3 }} {{ -(messages|length) // 2 }}
{{- 7 - messages|length * 2 }} {{ messages|length is odd }} {{ messages|length is divisibleby 2 }} {{ messages[9] is undefined }}
{{ undefined_thing is defined }}{{ undefined_thing|default('dflt') }}{{ undefined_thing }} {{ tools is none }} {{ none }}
{{- true and 'yes' }} {{ 0 or 'zero' }} {{ 'a' ~ 1 ~ none ~ true }} {{ add_generation_prompt is true }} {{ bos_token ~ eos_token }}
{{ [1, 2] == [1, 2] }} {{ {'a': [1, 'b', none], 'c': {}}|tojson(indent=2) }} {{ range(3)|join(',') }} {{ 1 < 2 < 3 }} {{ 'b' > 'a' }}
{{- messages[0] == messages[-1] }} {{ messages[0] is mapping }} {{ 'x' is iterable }} {{ 3 is number }} {{ 'a' * 3 }}
{{ "esc\\t\\x41\\u00e9" 'joined' }} {{ messages|first is defined }} {{ ('a' if false) is defined }} {{ [] is sequence }}
{%- if add_generation_prompt +%}
   gen
{%+ endif -%}
  x  {# comment #}
  y   {%- if true %} z {% endif %}
    {% if true -%}   w   {%- endif %}
"""


def test_the_rest_of_the_subset_renders_as_transformers(consumer, tmp_path):
    rng = random.Random("constructs")
    conversations = [(_conversation(rng), rng.random() < 0.5, {}) for _ in range(200)]
    _compare(consumer, CONSTRUCTS, *LLAMA3, conversations, tmp_path)


# Valid Jinja2 (transformers renders it) that the C++ renderer does not implement, and malformed templates.
UNSUPPORTED = {
    "macro": "{% macro m() %}x{% endmacro %}{{ m() }}",
    "call": "{% macro m() %}{{ caller() }}{% endmacro %}{% call m() %}x{% endcall %}",
    "include": "{% include 'other.jinja' %}",
    "raw": "{% raw %}{{ x }}{% endraw %}",
    "set block": "{% set x %}a{% endset %}{{ x }}",
    "break": "{% for m in messages %}{% break %}{% endfor %}",
    "filter block": "{% filter upper %}x{% endfilter %}",
    "recursive loop": "{% for m in messages recursive %}{% endfor %}",
    "float": "{{ 1.5 }}",
    "power": "{{ 2 ** 3 }}",
    "division": "{{ 4 / 2 }}",
    "tuple": "{% set a, b = 1, 2 %}",
    "filter": "{{ messages|sort }}",
    "test": "{% if messages is sameas messages %}{% endif %}",
    "dict()": "{{ dict(a=1) }}",
}
MALFORMED = {"unclosed block": "{% if true %}x", "unclosed tag": "hello {{ x ", "stray end": "{% endfor %}",
             "bad expression": "{{ 1 + }}", "unclosed comment": "{# x"}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED) + sorted(MALFORMED))
def test_what_is_not_implemented_is_refused_in_one_sentence(name, consumer, tmp_path):
    template = UNSUPPORTED.get(name) or MALFORMED[name]
    if name in UNSUPPORTED:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)  # Jinja2 takes it
    got = _render(consumer, template, *LLAMA3, [_case([{"role": "user", "content": "hi"}], True, {})], tmp_path)
    assert len(got) == 1 and got[0].startswith("refused chat template line 1: "), got
    assert got[0].count(". ") == 0 and not got[0].endswith(".."), got


@pytest.mark.parametrize("template", ["{{ messages }}", "{{ messages[0].content.title() }}", "{{ 'é'.upper() }}",
                                      "{{ strftime_now('%z') }}"])
def test_values_it_cannot_render_exactly_are_errors(template, consumer, tmp_path):
    got = _render(consumer, template, *LLAMA3, [_case([{"role": "user", "content": "hi"}], True, {})], tmp_path)
    assert len(got) == 1 and got[0].startswith("error chat template line 1: "), got
