"""Structured outputs and tool calling on the default model (issue 44): Python API first, then the server.

One model load for the whole file: the Python API tests drive `llm` directly; the server
tests then serve the same engine (from then on only the server's thread touches it).
Every constraint is checked at temperature 1 over >= 20 seeded samples with the referee
the format has (jsonschema, re.fullmatch, membership), in batches mixed with unconstrained
requests, with prefix caching on (the default), n = 2, and across forced preemption.
"""
from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import pytest

from kvforge import LLM, SamplingParams, StructuredOutputsParams
from kvforge.server.background import BackgroundServer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
CHOICES = ["red", "green", "blue", "yellow"]
GRAMMAR = 'start: "answer: " ("yes" | "no") " (" NUM ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"answer: (yes|no) \([0-9]{1,3}\)"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                   "required": ["tz"], "additionalProperties": False}}}


def holds(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(GRAMMAR_RE, text) is not None


SPECS = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX),
         "choice": StructuredOutputsParams(choice=CHOICES), "grammar": StructuredOutputsParams(grammar=GRAMMAR)}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=512, max_model_len=512, max_num_seqs=64, log_ledger=False)


def _constrained_batch(seed0: int) -> tuple[list[str], list[SamplingParams], list[str | None]]:
    prompts, params, kinds = [], [], []
    for k, (kind, spec) in enumerate(SPECS.items()):
        for i in range(10):  # n = 2: 20 samples per kind
            prompts.append(f"Write a {kind} answer. Example {i}:")
            params.append(SamplingParams(n=2, temperature=1.0, seed=seed0 + 100 * k + i, max_tokens=48,
                                         structured_outputs=spec))
            kinds.append(kind)
        prompts.append(f"Tell me a story about {kind}s.")  # unconstrained neighbours in the same batch
        params.append(SamplingParams(temperature=1.0, seed=seed0 + k, max_tokens=24))
        kinds.append(None)
    return prompts, params, kinds


@pytest.mark.slow
def test_every_constraint_holds_at_temperature_1_in_a_mixed_batch(llm):
    prompts, params, kinds = _constrained_batch(0)
    outs = llm.generate(prompts, params)
    free = [i for i, k in enumerate(kinds) if k is None]
    alone = llm.generate([prompts[i] for i in free], [params[i] for i in free])
    for i, solo in zip(free, alone):  # seeded unconstrained neighbours: the same tokens as without the masks
        assert outs[i].outputs[0].token_ids == solo.outputs[0].token_ids
    for out, kind in zip(outs, kinds):
        if kind is None:
            continue
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert holds(kind, c.text), (kind, c.text, c.finish_reason)
            assert c.finish_reason == "stop"
    assert llm.engine.structured.matchers == {}  # every matcher released


@pytest.mark.slow
def test_constraints_hold_across_forced_preemption(llm):
    engine = llm.engine
    words = r"([a-z]{3,8} ){20}[a-z]{3,8}\."  # 40-60 tokens: sequences outgrow their first blocks
    specs = {"json": SPECS["json"], "words": StructuredOutputsParams(regex=words)}
    engine.reconfigure_kv_cache(num_kv_blocks=8)  # 7 usable 16-token blocks; a words sequence alone needs 4-5
    try:
        prompts, params, kinds = [], [], []
        for i in range(8):
            kind = list(specs)[i % 2]
            prompts.append(f"Request {i}: give the {kind} answer now, please, in the required format.")
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=specs[kind]))
            kinds.append(kind)
        outs = llm.generate(prompts, params)
        assert engine.scheduler.num_preemptions > 0
        for out, kind in zip(outs, kinds):
            text = out.outputs[0].text
            assert holds(kind, text) if kind == "json" else re.fullmatch(words, text), (kind, text)
    finally:
        engine.reconfigure_kv_cache(num_kv_blocks=512)


def test_bad_constraints_are_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_with_tools_calls_them_in_the_generic_format(llm):
    outs = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                    SamplingParams(temperature=1.0, seed=3, max_tokens=80), tools=[WEATHER], tool_choice="required")
    env = json.loads(outs[0].outputs[0].text)
    call = env["tool_calls"][0]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])


# ---- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llm):
    srv = BackgroundServer(llm.engine, model_name="smol").start()
    yield srv
    srv.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "smol", **body}, timeout=120)


@pytest.mark.parametrize("kind,fields", [
    ("json", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}),
    ("regex", {"guided_regex": REGEX}),
    ("choice", {"structured_outputs": {"choice": CHOICES}}),
    ("grammar", {"guided_grammar": GRAMMAR}),
])
def test_server_constraints_hold_on_both_routes(server, kind, fields):
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"A {kind} please"}],
                                                  "n": 10, "temperature": 1.0, "seed": 7, "max_tokens": 48, **fields})
    comp = _post(server, "/v1/completions", {"prompt": f"A {kind}:", "n": 10, "temperature": 1.0, "seed": 9,
                                             "max_tokens": 48, **fields})
    assert chat.status_code == 200 and comp.status_code == 200, (chat.text, comp.text)
    texts = [c["message"]["content"] for c in chat.json()["choices"]] + [c["text"] for c in comp.json()["choices"]]
    assert len(texts) == 20
    assert all(holds(kind, t) for t in texts), texts


def test_json_object_is_a_json_object(server):
    r = _post(server, "/v1/completions", {"prompt": "JSON:", "max_tokens": 60, "temperature": 1.0, "seed": 1,
                                          "response_format": {"type": "json_object"}})
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["text"]), dict)
    else:
        assert c["text"].startswith("{")


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20000))}},
     "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"xyz_unknown": 1}, "xyz_unknown"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_bad_fields_get_a_400_naming_them(server, fields, param):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                               **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_hostile_schema_compiles_off_the_engine_loop(server, monkeypatch):
    """While a hostile schema compiles, an unconstrained stream keeps receiving tokens: the compile waits (after
    its real work) until the stream has advanced, which could never happen if it held the engine thread."""
    structured = server.async_engine.engine.structured
    real = structured.compile
    started, advanced, compiled_in_flight = threading.Event(), threading.Event(), threading.Event()

    def compile_and_wait(spec):  # type: ignore[no-untyped-def]
        if spec.field != "guided_json":
            return real(spec)
        started.set()
        try:
            return real(spec)
        finally:
            compiled_in_flight.set()
            assert advanced.wait(60), "the unconstrained stream stalled while a grammar compiled"

    monkeypatch.setattr(structured, "compile", compile_and_wait)
    hostile = {"type": "object", "properties": {
        "a": {"enum": [f"value-{i}-" + "x" * 20 for i in range(1500)]},  # ~45 KB, under the 64 KiB limit
        "b": _nested(40)}, "required": ["a", "b"]}
    results: dict = {}

    def send_hostile() -> None:
        results["r"] = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": hostile})

    tokens_during = 0
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "smol", "prompt": "Once upon a time", "max_tokens": 60, "stream": True,
                            "ignore_eos": True}) as resp:
        thread = None
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            if thread is None:
                thread = threading.Thread(target=send_hostile)
                thread.start()
                assert started.wait(60)
            elif started.is_set() and not advanced.is_set():
                tokens_during += 1
                if tokens_during >= 5:
                    advanced.set()
    thread.join(120)
    assert tokens_during >= 5
    assert results["r"].status_code in (200, 400), results["r"].text
    if results["r"].status_code == 400:
        assert results["r"].json()["error"]["param"] == "guided_json"


def _nested(depth: int) -> dict:
    node: dict = {"type": "integer"}
    for i in range(depth):  # objects and arrays in turn, each level naming the next once
        node = {"type": "object", "properties": {"k": node}, "required": ["k"]} if i % 2 else \
            {"type": "array", "items": node, "minItems": 1}
    return node


# ---- clients: the openai SDK and langchain-openai ------------------------------------------------
def _client(server):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_call(call, tools: list[dict]) -> None:  # type: ignore[no-untyped-def]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.id and call.type == "function" and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
def test_openai_sdk_tool_round_trip_required_named_and_streamed(server):
    client = _client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
    kw = dict(model="smol", temperature=1.0, seed=5, max_tokens=80)
    req = client.chat.completions.create(messages=messages, tools=[WEATHER, TIME], tool_choice="required", **kw)
    choice = req.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, [WEATHER, TIME])
    named = client.chat.completions.create(messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call, [WEATHER, TIME])
    # the streamed request reassembles to the same calls (same seed, same tokens)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                                stream=True, **kw):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert all(c["id"] for c in calls.values())
    # the history goes back with a tool result; the final answer is text
    history = messages + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "22 C and sunny" if c.function.name == "get_weather"
         else "14:05"} for c in choice.message.tool_calls]
    final = client.chat.completions.create(messages=history, tools=[WEATHER, TIME], tool_choice="none", **kw)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


@pytest.mark.slow
def test_langchain_bind_tools_and_structured_output_return_parsed_objects(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return "sunny"

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smol", temperature=1.0, seed=11,
                      max_tokens=80, max_retries=0)
    msg = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and {"city", "unit"} <= set(call["args"]) and call["id"]
    msg = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(person, Person), (method, person)
