"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Clients use them to count tokens before sending, and lm-evaluation-harness's `local-completions` probes
/tokenizer_info and /tokenize to tokenize through the server instead of downloading the tokenizer. Chat
messages are rendered by the same chat template /v1/chat/completions uses, so the count a client gets here
is the count the server will charge. The routes sit behind the app's API-key dependency like the others.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from kvforge.server.protocol import APIError, parse_chat_request
from kvforge.server.serving import OpenAIServing


_CHAT_RENDER_FIELDS = ("chat_template_kwargs", "tools", "tool_choice")  # vLLM's TokenizeChatRequest has them too


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise APIError(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


def tokenize(serving: OpenAIServing, body: Any) -> dict:
    """{"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}."""
    tok = _checked(serving, body, "prompt")
    if "messages" in body:
        # what changes the rendered prompt is passed on (and checked) as the chat route does: same text, same count
        chat = parse_chat_request({"messages": body["messages"],
                                   "add_generation_prompt": _flag(body, "add_generation_prompt", True),
                                   **{k: body[k] for k in _CHAT_RENDER_FIELDS if k in body}})
        _, ids = serving._tokenize(chat)[0]
        if _flag(body, "add_special_tokens", False) and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id] + ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(f"'prompt' must be a string (or send 'messages'), got {prompt!r:.60}", param="prompt")
        ids = tok.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    strs = [tok.id_to_token(t) for t in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(serving: OpenAIServing, body: Any) -> dict:
    """{"tokens": [ids]} -> {"prompt": text}."""
    tok = _checked(serving, body, "tokens")
    ids = body.get("tokens")
    vocab = serving.limits.vocab_size
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)):
        raise APIError(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def tokenizer_info(serving: OpenAIServing) -> dict:
    """The tokenizer's special tokens, chat template and limits, under Hugging Face's config names."""
    tok = serving.tokenizer
    if tok is None:
        raise APIError("this model has no tokenizer", status=404, code="no_tokenizer")

    def text(t: int | None) -> str | None:
        return None if t is None else tok.id_to_token(t)

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tok.vocab_size,
            "model_max_length": serving.max_model_len, "bos_token": text(tok.bos_token_id),
            "eos_token": text(eos), "pad_token": None, "unk_token": None, "add_bos_token": tok.add_bos_token,
            "add_eos_token": False, "chat_template": tok.chat_template}


def _checked(serving: OpenAIServing, body: Any, param: str) -> Any:
    """The tokenizer, once the body is an object naming this server's model (or none)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if serving.tokenizer is None:
        raise APIError("this model has no tokenizer", param=param)
    model = body.get("model")
    if model is not None and model != serving.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves '{serving.model_name}'",
                       status=404, param="model", code="model_not_found")
    return serving.tokenizer


def add_tokenizer_routes(app: FastAPI, serving: OpenAIServing, read_body: Any, dependencies: list) -> None:
    """Register the three routes; `read_body(request)` is the app's size- and time-limited JSON reader."""

    @app.post("/tokenize", dependencies=dependencies)
    async def tokenize_route(request: Request) -> dict:
        return tokenize(serving, await read_body(request))

    @app.post("/detokenize", dependencies=dependencies)
    async def detokenize_route(request: Request) -> dict:
        return detokenize(serving, await read_body(request))

    @app.get("/tokenizer_info", dependencies=dependencies)
    async def tokenizer_info_route() -> dict:
        return tokenizer_info(serving)
