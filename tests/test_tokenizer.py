"""Tokenizer: chat templates render like transformers, inside a sandbox that templates cannot escape."""
from __future__ import annotations

import os
from datetime import datetime

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from kvforge.models.loader import default_model_path
from kvforge.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 🤗"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall\nquietly"},
        {"role": "user", "content": "Another, in 日本語"},
    ],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from gguf import GGUFReader

    return Tokenizer.from_gguf(GGUFReader(default_model_path()))


@pytest.fixture(scope="module")
def ref_tok():
    """transformers' tokenizer built from the same GGUF (the reference)."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def tiny(template: str | None, **kw) -> Tokenizer:
    """A 3-token tokenizer with an arbitrary chat template."""
    backend = HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2}, unk_token="hi"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=0, eos_token_ids=[1], chat_template=template, **kw)


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, ref_tok, gen: bool) -> None:
    ref = ref_tok
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        got = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert got == want
        assert tok.encode(got) == ref.encode(want)


def test_smollm2_special_tokens(tok: Tokenizer) -> None:
    assert tok.has_chat_template
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"
    assert {0, 1, 2} <= set(tok.all_special_ids)
    prompt = tok.apply_chat_template(CONVERSATIONS[0])
    assert prompt.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" in prompt
    assert tok.encode(prompt)[0] == 1  # <|im_start|> is one token, not split
    assert tok.decode(tok.encode(prompt)) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
])
def test_sandbox_blocks_escapes(template: str) -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        tiny(template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers() -> None:
    t = tiny(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ bos_token }}{{ m | tojson }}{{ eos_token }}{% endfor %}{{ strftime_now('%Y') }}{{ extra }}"
    )
    out = t.apply_chat_template([{"role": "user", "content": "é <b>"}], extra="!")
    assert out == '<s>{"role": "user", "content": "é <b>"}</s>' + datetime.now().strftime("%Y") + "!"
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": "x"}])


@pytest.mark.parametrize("messages", [
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": 42}],
])
def test_malformed_messages(messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        tiny("{{ messages }}").apply_chat_template(messages)


def test_no_chat_template() -> None:
    t = tiny(None)
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_end_of_turn_tokens_from_template() -> None:
    backend = HFTokenizer(models.WordLevel({"<eos>": 0, "<|eot_id|>": 1, "x": 2}, unk_token="x"))
    with_eot = Tokenizer(backend, bos_token_id=None, eos_token_ids=[0], chat_template="{{ '<|eot_id|>' }}")
    assert with_eot.eos_token_ids == (0, 1)
    without = Tokenizer(backend, bos_token_id=None, eos_token_ids=[0, 0], chat_template="plain")
    assert without.eos_token_ids == (0,)


def test_bos_added_once() -> None:
    t = tiny(None, add_bos_token=True)
    assert t.encode("hi") == [0, 2]
    assert t.encode("hi", add_special_tokens=False) == [2]
    assert t.encode("<s> hi") == [0, 2]  # a template that already wrote BOS does not get a second
    with pytest.raises(ValueError, match="text"):
        t.encode(None)  # type: ignore[arg-type]
