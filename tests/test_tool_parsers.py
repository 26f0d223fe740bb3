"""Tool-call and reasoning parsers on recorded model-style texts, malformed ones included (issue 44).

Pure text in, (content, calls) out: a parser never raises, and text it cannot read stays
content. The streamed shape must reassemble to the same message as the whole reply.
"""
from __future__ import annotations

import json

import pytest

from kvforge.engine.chat_tools import generic_messages, native_messages, render_chat, tool_request
from kvforge.server.chat_output import ChatShape, ChoiceStream, message
from kvforge.server.reasoning import ReasoningStream, split_reasoning
from kvforge.server.tool_parsers import detect_parser, parse_envelope, parse_hermes, parse_llama3_json, parse_pythonic
from kvforge.tokenizer import Tokenizer

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
PYTHONIC = '[get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]'


def _calls(parsed):  # type: ignore[no-untyped-def]
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def test_hermes_reads_every_call_and_keeps_the_text_before():
    content, calls = parse_hermes(HERMES)
    assert content == "Let me check.\n"
    assert _calls((content, calls)) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                        ("get_time", {"tz": "CET"})]


def test_llama3_json_and_pythonic():
    assert _calls(parse_llama3_json(LLAMA)) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert _calls(parse_llama3_json('{"name": "f", "parameters": {"x": 1}}')) == [("f", {"x": 1})]
    assert _calls(parse_pythonic(PYTHONIC)) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("parser,text", [
    (parse_hermes, '<tool_call>\n{"name": "f", "arguments": {"x": 1</tool_call>'),  # truncated JSON
    (parse_hermes, '<tool_call>["not", "an object"]</tool_call>'),
    (parse_hermes, "no calls at all"),
    (parse_llama3_json, '{"name": "f", "parameters": {"x": 1}} trailing words'),
    (parse_llama3_json, '{"parameters": {}}'),  # no name
    (parse_llama3_json, "Sure! Here is the answer."),
    (parse_pythonic, "[get_weather(city=open('x'))]"),  # not a literal: never evaluated
    (parse_pythonic, "[1, 2, 3]"),
    (parse_pythonic, "[unclosed(city='Paris'"),
    (parse_envelope, '{"tool_calls": [{"name": 3}]}'),
    (parse_envelope, "{not json"),
])
def test_malformed_text_stays_content(parser, text):
    content, calls = parser(text)
    assert calls == [] and content == text


def test_envelope_reply_and_calls():
    assert parse_envelope('{"response": "Hello!"}') == ("Hello!", [])
    content, calls = parse_envelope('{"tool_calls": [{"name": "f", "arguments": {"a": [1, 2]}}]}')
    assert content is None and _calls((content, calls)) == [("f", {"a": [1, 2]})]


def test_detect_parser_from_the_template():
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{{ messages }}") is None


@pytest.mark.parametrize("kind,text,expected", [
    ("deepseek_r1", "I think 2+2=4.</think>\n\nThe answer is 4.", ("I think 2+2=4.", "The answer is 4.")),
    ("deepseek_r1", "<think>hmm</think>ok", ("hmm", "ok")),
    ("deepseek_r1", "cut short while thinking", ("cut short while thinking", None)),
    ("qwen3", "<think>\nplan\n</think>\n\nDone.", ("\nplan\n", "Done.")),
    ("qwen3", "No thinking here.", (None, "No thinking here.")),
    ("qwen3", "<think>unterminated", ("unterminated", None)),
])
def test_reasoning_split(kind, text, expected):
    assert split_reasoning(kind, text) == expected


@pytest.mark.parametrize("kind", ["deepseek_r1", "qwen3"])
def test_streamed_reasoning_reassembles_to_the_whole_split(kind):
    text = "<think>step one, step two</think>\n\nfinal answer"
    s = ReasoningStream(kind)
    parts = [s.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [s.feed("", final=True)]
    r, c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    assert (r or None, c or None) == split_reasoning(kind, text)
    assert all("<" not in p[0] + p[1] for p in parts)  # no tag fragment leaks


def _stream(shape: ChatShape, text: str, step: int = 4) -> tuple[dict, str | None]:
    """Feed `text` in pieces; reassemble content, reasoning and tool calls as an OpenAI client does."""
    s = ChoiceStream(shape)
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    reason = None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        deltas, reason = s.feed(piece, "stop" if k == len(pieces) - 1 else None)
        for d in deltas:
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls", []):
                slot = msg["tool_calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert slot["name"] is None, "id and name come first, once"
                    slot["name"] = tc["function"]["name"]
                slot["arguments"] += tc["function"].get("arguments", "")
    return msg, reason


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("llama3_json", LLAMA), ("pythonic", PYTHONIC),
                                         ("envelope", '{"tool_calls": [{"name": "f", "arguments": {"q": "x y"}}]}')])
def test_streamed_tool_calls_reassemble_to_the_whole_message(parser, text):
    shape = ChatShape(parser)
    whole, reason = message(shape, text, "stop")
    assert reason == "tool_calls"
    streamed, sreason = _stream(shape, text)
    assert sreason == "tool_calls"
    assert (streamed["content"] or None) == whole["content"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_streamed_plain_text_under_a_tool_parser_streams_as_content():
    shape = ChatShape("hermes", "deepseek_r1")
    text = "thinking</think>Just an answer, <tool_ but no call."
    whole, reason = message(shape, text, "stop")
    streamed, sreason = _stream(shape, text, 3)
    assert reason == sreason == "stop"
    assert streamed["content"] == whole["content"] == "Just an answer, <tool_ but no call."
    assert streamed["reasoning_content"] == whole["reasoning_content"] == "thinking"


def _tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as HF, models

    return Tokenizer(HF(models.BPE()), bos_token_id=None, eos_token_ids=[], chat_template=template)


def test_native_templates_get_tools_and_history_as_transformers_passes_them():
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}"
                "{% endif %};{% endfor %}{% if enable_thinking is false %}/no_think{% endif %}")
    tools = tool_request([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = render_chat(_tokenizer(template), msgs, tools, True, {"enable_thinking": False})
    assert text == "[tool get_weather]user:weather?;assistant:get_weather(Oslo);tool:sunny;/no_think"
    assert native_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_generic_format_describes_tools_and_turns_history_into_text():
    tools = tool_request([{"type": "function", "function": {"name": "f", "description": "does f"}}], "auto")
    msgs = generic_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                             {"role": "tool", "tool_call_id": "c", "content": "42"}], tools)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.") and '"f"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "f", "arguments": {}}]}
    assert msgs[3]["role"] == "user" and json.loads(msgs[3]["content"])["tool_response"]["content"] == "42"


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([{"type": "function"}], None, "tools"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "f"}}], "sometimes", "tool_choice"),
])
def test_bad_tool_fields_name_the_field(tools, choice, param):
    from kvforge.engine.chat_tools import ToolFieldError

    with pytest.raises(ToolFieldError) as exc:
        tool_request(tools, choice)
    assert exc.value.param == param
