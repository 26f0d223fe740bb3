"""OpenAI completions and chat: tokenize, check with the engine, run, shape the JSON.

Each prompt is one engine request carrying `n`, as LLM.generate does: the engine prefills it
once and forks n samples that share the prompt's blocks. Choice `p * n + i` is sample i of
prompt p. The admission check is the engine's own (`LLMEngine.check_request`); this module
only maps its field names onto the API's ("prompt" -> "messages" for chat).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import jinja2

from kvforge.engine.chat_tools import render_chat
from kvforge.engine.outputs import CompletionOutput, RequestOutput
from kvforge.engine.request_check import RequestRejected
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.structured.params import StructuredOutputError
from kvforge.server.async_engine import AsyncEngine
from kvforge.server.chat_output import ChoiceStream, message
from kvforge.server.chat_setup import chat_shape, with_tool_constraint
from kvforge.server.echo import echo_choice, vllm_prompt_logprobs
from kvforge.server.logprobs import chat_logprobs, completion_logprobs
from kvforge.server.protocol import APIError, GenerationRequest
from kvforge.server.request_group import EngineDeadError, RequestFailedError, RequestGroup, SubRequest

# What a chat template or tokenizer raises on input it cannot render: the client's fault, never a 500.
# OverflowError: the sandbox's range() limit; RecursionError: a template recursing on deep input.
_RENDER_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, UnicodeError, jinja2.TemplateError)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.tokenizer = engine.engine.tokenizer
        self.model_name = model_name
        self.limits = engine.engine.limits
        self.max_model_len = self.limits.max_seq_len  # effective: also bounded by what the KV cache holds

    # ---- preparation ----------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> tuple[str, list[SubRequest]]:
        """Validate against the model and the engine's limits; returns (response id, one sub-request per prompt)."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        base = f"{prefix}-{uuid.uuid4().hex}"
        field = "messages" if req.kind == "chat" else "prompt"
        params = _sampling_params(req)
        if req.kind == "chat":
            req.shape = chat_shape(req, self.tokenizer, self.tool_call_parser, self.reasoning_parser)
            params = with_tool_constraint(req, params, self.tokenizer)
        subs: list[SubRequest] = []
        for p, (text, ids) in enumerate(self._tokenize(req)):
            try:
                self.engine.engine.check_request(ids, params, strict_max_tokens=True)
            except RequestRejected as exc:
                raise _rejected(exc, field) from exc
            subs.append(SubRequest(f"{base}-{p}", text, ids, params, req.cache_salt))
        return base, subs

    def _tokenize(self, req: GenerationRequest) -> list[tuple[str | None, list[int]]]:
        tok = self.tokenizer
        if req.kind == "chat":
            if tok is None or not tok.has_chat_template:
                raise APIError("this model has no chat template; use /v1/completions", param="messages")
            try:
                text = render_chat(tok, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
                return [(text, tok.encode(text, add_special_tokens=False))]
            except _RENDER_ERRORS as exc:
                raise APIError(f"the chat template could not render the messages: {_short(exc)}",
                               param="messages") from exc
        out: list[tuple[str | None, list[int]]] = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                if tok is None:
                    raise APIError("this model has no tokenizer; send 'prompt' as token ids", param="prompt")
                try:
                    out.append((prompt, tok.encode(prompt)))
                except _RENDER_ERRORS as exc:
                    raise APIError(f"'prompt' could not be tokenized: {_short(exc)}", param="prompt") from exc
            else:
                out.append((None, list(prompt)))
        return out

    async def submit(self, req: GenerationRequest, subs: list[SubRequest]) -> RequestGroup:
        spec = subs[0].params.structured_outputs if subs else None
        if spec is not None:  # compiled on a worker thread (llguidance drops the GIL): the engine only copies it
            try:
                await asyncio.to_thread(self.engine.engine.structured.compile, spec)
            except StructuredOutputError as exc:
                raise APIError(str(exc), param=exc.param) from exc
        try:
            return await self.engine.submit(subs)
        except RequestRejected as exc:
            raise _rejected(exc, "messages" if req.kind == "chat" else "prompt") from exc
        except EngineDeadError as exc:
            raise _unavailable(exc) from exc

    # ---- non-streaming ---------------------------------------------------------------------
    async def complete(self, req: GenerationRequest, base: str, subs: list[SubRequest], group: RequestGroup) -> dict:
        finals: dict[int, RequestOutput] = {}  # by prompt index
        try:
            async for p, out in group:
                if out.finished:
                    finals[p] = out
        except EngineDeadError as exc:
            raise _unavailable(exc) from exc
        except RequestFailedError as exc:
            raise APIError(str(exc), status=500, type="server_error", code="internal_error") from exc
        finally:
            group.abort()
        choices = []
        for p in range(len(subs)):
            for c in finals[p].outputs:
                idx = p * req.n + c.index
                lp = self._logprobs(req, c.token_ids, c.logprobs)
                if req.kind == "chat":
                    msg, reason = message(req.shape, c.text, c.finish_reason)
                    choices.append({"index": idx, "message": msg,
                                    "logprobs": lp, "finish_reason": reason, "stop_reason": c.stop_reason})
                else:
                    text = c.text
                    if req.echo:  # the prompt's text and scores first (kvforge/server/echo.py)
                        text, lp = echo_choice(self.tokenizer, finals[p], c, req.logprobs, req.max_tokens == 0)
                    choice = {"index": idx, "text": text, "logprobs": lp,
                              "finish_reason": "length" if req.max_tokens == 0 else c.finish_reason,
                              "stop_reason": None if req.max_tokens == 0 else c.stop_reason}
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, finals[p].prompt_logprobs)
                    choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        obj = "chat.completion" if req.kind == "chat" else "text_completion"
        body = {"id": base, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": _usage(subs, finals, req.max_tokens == 0)}
        if req.kind == "chat" and req.prompt_logprobs is not None:  # vLLM: one list for the chat's one prompt
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, finals[0].prompt_logprobs)
        return body

    # ---- streaming -------------------------------------------------------------------------
    async def stream(self, req: GenerationRequest, base: str, subs: list[SubRequest],
                     group: RequestGroup) -> AsyncIterator[str]:
        """Server-sent events; always ends with `[DONE]` (after an error event if the request failed)."""
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        shaped: dict[int, ChoiceStream] = {}  # chat with tools or reasoning: per choice

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict = {"id": base, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if req.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if req.kind == "chat":
                for idx in range(len(subs) * req.n):
                    yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for p, out in group:
                if out.finished:
                    finals[p] = out
                for c in out.outputs:
                    idx = p * req.n + c.index
                    if idx in done:
                        continue  # a sample that finished earlier is repeated in its request's final output
                    if not (c.delta_text or c.finished or (req.logprobs is not None and c.delta_token_ids)):
                        continue  # e.g. half a UTF-8 character, or text held back as a possible stop string
                    if req.kind == "chat" and not req.shape.plain:
                        stream = shaped.setdefault(idx, ChoiceStream(req.shape))
                        for part in self._shaped_choices(req, idx, c, sent_tokens, stream, out):
                            yield chunk([part])
                    else:
                        yield chunk([self._stream_choice(req, idx, c, sent_tokens, out)])
                    if c.finished:
                        done.add(idx)
            if req.include_usage:
                yield chunk([], _usage(subs, finals))
        except EngineDeadError as exc:
            yield f"data: {json.dumps(_unavailable(exc).body())}\n\n"
        except RequestFailedError as exc:
            err = APIError(str(exc), status=500, type="server_error", code="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            group.abort()
        yield "data: [DONE]\n\n"

    def _stream_choice(self, req: GenerationRequest, idx: int, c: CompletionOutput, sent: dict[int, int],
                       out: RequestOutput) -> dict:
        first = idx not in sent
        start = sent.get(idx, 0)
        sent[idx] = len(c.token_ids)
        lp = self._logprobs(req, c.token_ids[start:], (c.logprobs or [])[start:])
        choice: dict = {"index": idx, "logprobs": lp, "finish_reason": c.finish_reason}
        if req.kind == "chat":
            choice["delta"] = {"content": c.delta_text} if c.delta_text or not c.finished else {}
        else:
            choice["text"] = c.delta_text
            if req.echo and first:  # the first chunk of a choice carries the prompt (everything before it was empty)
                choice["text"], choice["logprobs"] = echo_choice(self.tokenizer, out, c, req.logprobs,
                                                                    req.max_tokens == 0)
        if req.prompt_logprobs is not None and first:  # vLLM's extension, with the choice's first chunk
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, out.prompt_logprobs)
        if req.max_tokens == 0:
            choice["finish_reason"] = "length"
        if c.finished:
            choice["stop_reason"] = None if req.max_tokens == 0 else c.stop_reason
        return choice

    def _shaped_choices(self, req: GenerationRequest, idx: int, c: CompletionOutput, sent: dict[int, int],
                        stream: ChoiceStream, out: RequestOutput) -> list[dict]:
        """A chat choice through its ChoiceStream: reasoning, content and tool-call deltas, the finish last."""
        base = self._stream_choice(req, idx, c, sent, out)
        deltas, reason = stream.feed(c.delta_text, c.finish_reason)
        parts = [{**{k: v for k, v in base.items() if k != "stop_reason"}, "delta": d, "finish_reason": None}
                 for d in deltas]
        if c.finished:
            parts.append({**base, "delta": {}, "finish_reason": reason, "logprobs": None if parts else base["logprobs"]})
        elif parts:
            for p in parts[1:]:
                p["logprobs"] = None
        return parts

    def _logprobs(self, req: GenerationRequest, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None) -> dict | None:
        if req.logprobs is None or logprobs is None or self.tokenizer is None:
            return None
        fn = chat_logprobs if req.kind == "chat" else completion_logprobs
        return fn(self.tokenizer, token_ids, logprobs, req.logprobs)


def _sampling_params(req: GenerationRequest) -> SamplingParams:
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # echoed logprobs cover the prompt: score it with the same top-N
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # 0 (echo): the one sampled token is dropped
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                              **req.sampling)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_param_of(str(exc), None)) from exc


def _param_of(message: str, default: str | None) -> str | None:
    """SamplingParams and the engine start their messages with the offending field's name."""
    word = message.split(" ", 1)[0].strip("'\":")
    return word if word.isidentifier() else default


def _rejected(exc: RequestRejected, field: str) -> APIError:
    """The engine's check speaks of "prompt"; chat requests name their field "messages"."""
    message, param = str(exc), exc.param
    if param == "prompt":
        param = field
        if message.startswith("prompt "):
            message = f"'{field}'" + message[len("prompt"):]
    return APIError(message, param=param, code=exc.code)


def _short(exc: BaseException) -> str:
    """An exception's message for a client: its type and first 200 characters, never a traceback."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _unavailable(exc: EngineDeadError) -> APIError:
    return APIError(str(exc), status=503, type="server_error", code=exc.code)


def _usage(subs: list[SubRequest], finals: dict[int, RequestOutput], scored_only: bool = False) -> dict:
    """`scored_only`: max_tokens 0 with echo, whose one sampled token is dropped from the response."""
    prompt = sum(len(s.prompt_token_ids) for s in subs)
    cached = sum(out.num_cached_tokens for out in finals.values())
    completion = 0 if scored_only else sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
