"""The server's OpenAPI 3.1 schema, written to match protocol.py's validation (served at /openapi.json).

The routes read their bodies by hand (size limit, deadline, OpenAI-style errors), so FastAPI
cannot derive request schemas from type hints; this module states them instead, and the
schemathesis test (tests/test_api_fuzz.py) holds the server to them: schema-valid bodies get
200 or a 4xx naming the field, and nothing ever gets a 5xx.
"""
from __future__ import annotations

from typing import Any

from kvforge.engine.sampling_params import SEED_MAX
from kvforge.kv.salt import MAX_CACHE_SALT_CHARS

_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "description": "at most the server's max_num_seqs"},
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": SEED_MAX},
    "min_tokens": {"type": "integer", "minimum": 0},
    "ignore_eos": _BOOL,
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                   "description": "requests with different salts never share cached KV blocks"},
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "description": "OpenAI's, over generated tokens"},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "description": "OpenAI's, over generated tokens"},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "description": "transformers', prompt + output"},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id (a string) -> bias added to its logit"},
    "allowed_token_ids": _TOKEN_IDS,
    "bad_words": {"type": "array", "items": {"type": "string"}},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "vLLM's: top-k per prompt token"},
    # structured outputs (kvforge/server/structured_fields.py; docs/agents.md): at most one per request
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": ["boolean", "null"]}}}}},
    "structured_outputs": {"type": "object", "description": "one of json, regex, choice, grammar, json_object"},
    "guided_json": {"type": "object"},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array", "items": {"type": "string"}},
    "guided_grammar": {"type": "string", "description": "Lark, or GBNF"},
    "guided_decoding_backend": {"enum": ["auto", "guidance", "llguidance"]},
}

COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_COMMON,
        "prompt": {"oneOf": [
            {"type": "string"},
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string"}, _TOKEN_IDS]}},
        ]},
        "max_tokens": {"type": "integer", "minimum": 0, "description": "default 16; 0 only with echo (score the prompt)"},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "echo": {"type": "boolean", "description": "prepend the prompt (and its logprobs) to each choice"},
        "best_of": {"type": "integer", "minimum": 1, "description": ">= n; not with stream"},
    },
}

_CONTENT_PART = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string"},
                           "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART},
                                                 {"type": "null", "description": "with tool_calls"}]},
                           "tool_calls": {"type": "array", "items": {"type": "object"}},
                           "tool_call_id": {"type": "string"}},
        }},
        "add_generation_prompt": _BOOL,
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": _BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "requires logprobs"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": _BOOL,
        "chat_template_kwargs": {"type": "object"},
        "include_reasoning": _BOOL,
    },
}

ERROR: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_OBJECT = {"type": "object"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation(summary: str, request_ref: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": request_ref}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events when stream is true",
                    "content": {"application/json": {"schema": _OBJECT}, "text/event-stream": {"schema": {"type": "string"}}}},
            "400": _json({"$ref": "#/components/schemas/Error"}, "invalid request; error.param names the field"),
            "401": _json({"$ref": "#/components/schemas/Error"}, "missing or wrong API key"),
            "404": _json({"$ref": "#/components/schemas/Error"}, "unknown model"),
            "408": _json({"$ref": "#/components/schemas/Error"}, "the body did not arrive in time"),
            "413": _json({"$ref": "#/components/schemas/Error"}, "the body is too large"),
            "415": _json({"$ref": "#/components/schemas/Error"},
                         "the body is not application/json, or is compressed; error.param names the header"),
            "503": _json({"$ref": "#/components/schemas/Error"}, "queue full (Retry-After) or shutting down"),
        },
    }}


TOKENIZE_REQUEST: dict[str, Any] = {"type": "object", "properties": {
    "model": {"type": "string"}, "prompt": {"type": "string"}, "messages": CHAT_REQUEST["properties"]["messages"],
    "add_special_tokens": _BOOL, "add_generation_prompt": _BOOL, "return_token_strs": _BOOL}}
DETOKENIZE_REQUEST: dict[str, Any] = {"type": "object", "required": ["tokens"], "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}


def _tokenizer_route(summary: str, request: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                     "responses": {"200": _json(_OBJECT, "result"),
                                   "400": _json({"$ref": "#/components/schemas/Error"}, "invalid request"),
                                   "401": _json({"$ref": "#/components/schemas/Error"}, "bad key"),
                                   "404": _json({"$ref": "#/components/schemas/Error"}, "unknown model")}}}


def openapi_schema(with_auth: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvforge", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat over kvforge's engine."},
        "paths": {
            "/v1/completions": _generation("Text completion", "#/components/schemas/CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "#/components/schemas/ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "The served model, with its effective max_model_len and KV capacity",
                                   "responses": {"200": _json(_OBJECT, "model list"),
                                                 "401": _json({"$ref": "#/components/schemas/Error"}, "bad key")}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "One model's card; 404 for any id but the served model's",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json(_OBJECT, "model card"),
                              "401": _json({"$ref": "#/components/schemas/Error"}, "bad key"),
                              "404": _json({"$ref": "#/components/schemas/Error"}, "unknown model")}}},
            "/tokenize": _tokenizer_route("Prompt or chat messages -> token ids, count, max_model_len",
                                          TOKENIZE_REQUEST),
            "/detokenize": _tokenizer_route("Token ids -> text", DETOKENIZE_REQUEST),
            "/tokenizer_info": {"get": {"summary": "Special tokens, chat template and limits of the tokenizer",
                                        "responses": {"200": _json(_OBJECT, "tokenizer info"),
                                                      "401": _json({"$ref": "#/components/schemas/Error"}, "bad key")}}},
            "/health": {"get": {"summary": "200 while serving; 503 when the engine stopped or while draining",
                                "security": [],
                                "responses": {"200": _json(_OBJECT, "serving"),
                                              "503": _json({"$ref": "#/components/schemas/Error"}, "not serving")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text format 0.0.4)",
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               "401": _json({"$ref": "#/components/schemas/Error"}, "bad key")}}},
        },
        "components": {"schemas": {"CompletionRequest": COMPLETION_REQUEST, "ChatCompletionRequest": CHAT_REQUEST,
                                   "Error": ERROR}},
    }
    if with_auth:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema
