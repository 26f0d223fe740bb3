"""OpenAI completions and chat: tokenize, check lengths, fan out n samples, run, shape the JSON.

n > 1 is fanned out here into n engine requests (ids f"{id}-{i}", seed + i),
as LLM.generate does, because LLMEngine.add_request takes one sample each.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import jinja2

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.server.async_engine import AsyncEngine
from kvforge.server.logprobs import chat_logprobs, completion_logprobs
from kvforge.server.protocol import APIError, GenerationRequest
from kvforge.server.request_group import EngineDeadError, RequestGroup, SubRequest


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.engine.scheduler.config.max_model_len
        self.max_seq_len = engine.engine.scheduler.max_seq_len  # also bounded by the KV cache size

    # ---- preparation ----------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> tuple[str, list[SubRequest]]:
        """Validate against the model and the engine's limits; returns (response id, sub-requests)."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        base = f"{prefix}-{uuid.uuid4().hex}"
        field = "messages" if req.kind == "chat" else "prompt"
        subs: list[SubRequest] = []
        for p, (text, ids) in enumerate(self._tokenize(req)):
            max_tokens = self._check_lengths(req, len(ids), field)
            params = _sampling_params(req, max_tokens)
            for i in range(req.n):
                sub_params = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
                subs.append(SubRequest(f"{base}-{p * req.n + i}", text, ids, sub_params))
        return base, subs

    def _tokenize(self, req: GenerationRequest) -> list[tuple[str | None, list[int]]]:
        tok = self.tokenizer
        if req.kind == "chat":
            if tok is None or not tok.has_chat_template:
                raise APIError("this model has no chat template; use /v1/completions", param="messages")
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
            except (ValueError, jinja2.TemplateError) as exc:
                raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from exc
            return [(text, tok.encode(text, add_special_tokens=False))]
        out: list[tuple[str | None, list[int]]] = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                if tok is None:
                    raise APIError("this model has no tokenizer; send 'prompt' as token ids", param="prompt")
                out.append((prompt, tok.encode(prompt)))
            else:
                out.append((None, list(prompt)))
        return out

    def _check_lengths(self, req: GenerationRequest, n_prompt: int, field: str) -> int:
        limit = self.max_seq_len
        what = "max_model_len" if limit == self.max_model_len else "the KV cache capacity (tokens)"
        if n_prompt == 0:
            raise APIError(f"'{field}' is empty: it must contain at least one token", param=field)
        if n_prompt >= limit:
            raise APIError(f"'{field}' has {n_prompt} tokens but {what} is {limit}; the prompt and at least "
                           "one generated token must fit", param=field, code="context_length_exceeded")
        if req.max_tokens is None:
            return limit - n_prompt
        if n_prompt + req.max_tokens > limit:
            raise APIError(f"'max_tokens' is {req.max_tokens} but the prompt has {n_prompt} tokens and {what} is "
                           f"{limit}: at most {limit - n_prompt} new tokens fit", param="max_tokens",
                           code="context_length_exceeded")
        return req.max_tokens

    async def submit(self, req: GenerationRequest, subs: list[SubRequest]) -> RequestGroup:
        try:
            return await self.engine.submit(subs)
        except ValueError as exc:  # the engine's own prompt checks (e.g. token ids out of range)
            param = "messages" if req.kind == "chat" else "prompt"
            raise APIError(str(exc), param="kv_budget" if str(exc).startswith("kv_budget") else param) from exc
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503, type="server_error", code="engine_unavailable") from exc

    # ---- non-streaming ---------------------------------------------------------------------
    async def complete(self, req: GenerationRequest, base: str, subs: list[SubRequest], group: RequestGroup) -> dict:
        finals: dict[int, RequestOutput] = {}
        try:
            async for idx, out in group:
                if out.finished:
                    finals[idx] = out
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503, type="server_error", code="engine_unavailable") from exc
        finally:
            group.abort()
        choices = []
        for idx in range(len(subs)):
            c = finals[idx].outputs[0]
            lp = self._logprobs(req, c.token_ids, c.logprobs)
            if req.kind == "chat":
                choices.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": idx, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        obj = "chat.completion" if req.kind == "chat" else "text_completion"
        return {"id": base, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": _usage(req, subs, finals)}

    # ---- streaming -------------------------------------------------------------------------
    async def stream(self, req: GenerationRequest, base: str, subs: list[SubRequest],
                     group: RequestGroup) -> AsyncIterator[str]:
        """Server-sent events; the group is aborted whenever this generator stops early."""
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        sent_tokens = [0] * len(subs)

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict = {"id": base, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if req.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if req.kind == "chat":
                for idx in range(len(subs)):
                    yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for idx, out in group:
                c = out.outputs[0]
                if not (c.delta_text or out.finished or (req.logprobs is not None and c.delta_token_ids)):
                    continue  # e.g. half a UTF-8 character, or text held back as a possible stop string
                start = sent_tokens[idx]
                sent_tokens[idx] = len(c.token_ids)
                lp = self._logprobs(req, c.token_ids[start:], (c.logprobs or [])[start:])
                choice: dict = {"index": idx, "logprobs": lp, "finish_reason": c.finish_reason}
                if req.kind == "chat":
                    choice["delta"] = {"content": c.delta_text} if c.delta_text or not out.finished else {}
                else:
                    choice["text"] = c.delta_text
                if out.finished:
                    finals[idx] = out
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
            if req.include_usage:
                yield chunk([], _usage(req, subs, finals))
        except EngineDeadError as exc:
            err = APIError(str(exc), status=503, type="server_error", code="engine_unavailable")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            group.abort()
        yield "data: [DONE]\n\n"

    def _logprobs(self, req: GenerationRequest, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None) -> dict | None:
        if req.logprobs is None or logprobs is None or self.tokenizer is None:
            return None
        fn = chat_logprobs if req.kind == "chat" else completion_logprobs
        return fn(self.tokenizer, token_ids, logprobs, req.logprobs)


def _sampling_params(req: GenerationRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(n=1, max_tokens=max_tokens, logprobs=req.logprobs, **req.sampling)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_param_of(str(exc), None)) from exc


def _param_of(message: str, default: str | None) -> str | None:
    """SamplingParams and the engine start their messages with the offending field's name."""
    word = message.split(" ", 1)[0].strip("'\":")
    return word if word.isidentifier() else default


def _usage(req: GenerationRequest, subs: list[SubRequest], finals: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(subs[p * req.n].prompt_token_ids) for p in range(len(subs) // req.n))
    cached = sum(finals[p * req.n].num_cached_tokens for p in range(len(subs) // req.n) if p * req.n in finals)
    completion = sum(len(o.outputs[0].token_ids) for o in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
