"""Per-request output state: incremental text, stop strings, logprobs, timings.

Turns each sampled token into a RequestOutput carrying both the cumulative
text and the delta since the last output (for streaming). Text that might be
the start of a stop string is held back until it is disambiguated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvforge.engine.request import Request
from kvforge.engine.sampler import SampleResult
from kvforge.engine.stop import StopStringMatcher


@dataclass
class _State:
    prompt: str | None
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    metrics: RequestMetrics
    emitted_text: str = ""
    emitted_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_text: str | None = None
    visible: str = ""  # text the caller may see now (held-back stop-string prefixes excluded)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def add(self, req: Request, prompt: str | None, max_len: int) -> None:
        p = req.sampling_params
        detok = (
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        stops = StopStringMatcher(p.stop_strings, p.include_stop_str_in_output) if p.stop_strings and detok is not None else None
        self.states[req.request_id] = _State(
            prompt, detok, stops, RequestMetrics(req.arrival_time),
            logprobs=[] if p.logprobs is not None else None,
            cumulative_logprob=0.0 if p.logprobs is not None else None,
        )

    def process(self, req: Request, result: SampleResult) -> tuple[RequestOutput, bool]:
        """Record the token `req` just got; returns its output and whether a stop string matched."""
        st = self.states[req.request_id]
        now = time.monotonic()
        if st.metrics.first_token_time is None:
            st.metrics.first_token_time = now
            st.metrics.first_scheduled_time = req.first_scheduled_time
        st.metrics.last_token_time = now
        if st.logprobs is not None and result.logprob is not None:
            top = dict(result.top_logprobs or {})
            top[result.token_id] = result.logprob
            st.logprobs.append(top)
            st.cumulative_logprob = (st.cumulative_logprob or 0.0) + result.logprob
        stop_hit = False
        if st.detok is not None:
            token = req.output_token_ids[-1]
            ends = token in req.eos_token_ids or token in req.sampling_params.stop_token_ids
            st.detok.push([] if ends and req.is_finished and req.sampling_params.skip_special_tokens else [token])
            if req.is_finished:
                st.detok.flush()
            full = st.detok.text
            st.visible = full
            if st.stops is not None:
                check = st.stops.check(full, len(st.emitted_text))
                if check.stop_index is not None:
                    stop_hit = True
                    st.stop_text = req.stop_reason = st.stops.matched_stop(full, check.stop_index)
                    st.visible = full[: check.stop_index]
                elif not req.is_finished:
                    st.visible = st.emitted_text + check.text
        return self._output(req, finished=req.is_finished or stop_hit), stop_hit

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        st = self.states[req.request_id]
        text = st.visible
        delta = text[len(st.emitted_text):]
        st.emitted_text = text
        new_tokens = req.output_token_ids[st.emitted_tokens:]
        st.emitted_tokens = req.num_output_tokens
        reason = None
        if finished:
            reason = "stop" if (st.stop_text is not None or req.status.value == "stop") else req.status.value
            st.metrics.finished_time = time.monotonic()
            st.metrics.num_preemptions = req.num_preemptions
            self.states.pop(req.request_id, None)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids), cumulative_logprob=st.cumulative_logprob,
            logprobs=list(st.logprobs) if st.logprobs is not None else None, finish_reason=reason,
            stop_reason=req.stop_reason, delta_text=delta, delta_token_ids=list(new_tokens),
        )
        return RequestOutput(
            req.request_id, st.prompt, list(req.prompt_token_ids), [completion], finished,
            req.num_cached_prompt_tokens, st.metrics,
        )

    def abort(self, req: Request) -> RequestOutput | None:
        if req.request_id not in self.states:
            return None
        return self._output(req, finished=True)
