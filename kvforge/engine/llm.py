"""LLM: the offline batch API, shaped like vLLM's so users feel at home."""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dataclasses import replace

from kvforge.engine.args import EngineArgs, EngineConfig
from kvforge.engine.chat_tools import output_constraint, render_chat, tool_request
from kvforge.engine.engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvforge.kv.explain import PrefixMissReport


class LLM:
    """`LLM(model=None)` loads the default model; every engine option (`EngineConfig`) is a keyword."""

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine_args(cls, args: EngineConfig) -> "LLM":
        """Build from an already validated EngineConfig (the CLI path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass either prompts or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            items: list[tuple[str | None, list[int] | None]] = [(None, list(ids)) for ids in prompt_token_ids]
        elif prompts is not None:
            items = [(p, None) for p in ([prompts] if isinstance(prompts, str) else list(prompts))]
        else:
            raise ValueError("prompts or prompt_token_ids is required")
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(items)} prompts")
        return self._run(items, params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a batch of them, rendered with the model's chat template.

        `tools` (OpenAI's format) reach the template as transformers' `apply_chat_template(tools=...)` passes
        them; a template without tool support gets kvforge's generic format, and then (or with tool_choice
        "required" or a named function) the reply is held to the JSON envelope of engine/chat_tools.py."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat is unavailable")
        tool_req = tool_request(tools, tool_choice)
        params = sampling_params or SamplingParams()
        spec = output_constraint(self.tokenizer, tool_req)
        if spec is not None:
            if params.structured_outputs is not None:
                raise ValueError("structured_outputs cannot be combined with tools that constrain the reply")
            params = replace(params, structured_outputs=spec)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.tokenizer, c, tool_req, add_generation_prompt, chat_template_kwargs)  # type: ignore[arg-type]
                   for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self._run([(p, i) for p, i in zip(prompts, ids)], [params] * len(ids), use_tqdm, None)

    def _run(self, items, params, use_tqdm, cache_salt) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
        """Submit everything, step until every request is finished; n > 1 is native (one prefill, forked)."""
        engine = self.engine
        submitted: list[str] = []
        try:
            for (prompt, ids), p in zip(items, params):
                submitted.append(engine.add_request(prompt, p, ids, cache_salt=cache_salt))
        except ValueError:
            for rid in submitted:  # bad input loses nothing: withdraw what this call queued
                engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = _progress(len(submitted), use_tqdm)
        start, tokens = time.monotonic(), 0
        try:
            while len(finals) < len(submitted):
                for out in engine.step():
                    tokens += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(f"{tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s", refresh=False)
        except BaseException:
            for rid in submitted:
                if rid not in finals:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[rid] for rid in submitted]

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Write cached prefix blocks to the KV tiers (kv_disk_cache: a restart serves them) and stop the disk writer."""
        self.engine.close()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per-tier hits and queries (tokens), bytes written and read, load seconds, evictions."""
        return self.engine.tier_stats()

    def explain_prefix_miss(
        self, prompt_a: str, prompt_b: str, cache_salt_a: str | None = None, cache_salt_b: str | None = None
    ) -> "PrefixMissReport":
        """Why `prompt_b` does not reuse `prompt_a`'s cached blocks: hits, first diverging token and block,
        the text around it, and a warning when the difference looks dynamic (timestamp, UUID, whitespace)."""
        from kvforge.kv.explain import explain

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; call kvforge.kv.explain.explain with token ids")
        tok = self.tokenizer
        return explain(tok.encode(prompt_a), tok.encode(prompt_b), self.engine.kv.block_size, tok.decode,
                       prompt_a, prompt_b, cache_salt_a, cache_salt_b)


def _progress(total: int, use_tqdm: bool | None):  # type: ignore[no-untyped-def]
    if use_tqdm is False or (use_tqdm is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
