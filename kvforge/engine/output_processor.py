"""Per-request output state: incremental text, stop strings, logprobs, timings.

Turns each sampled token into a CompletionOutput carrying both the cumulative
text and the delta since the last output (for streaming). Text that might be
the start of a stop string is held back until it is disambiguated. A request
with n > 1 samples is a group: each step yields one RequestOutput per group
holding the samples that advanced, and the last one carries all n completions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvforge.engine.prompt_logprobs import PromptScores
from kvforge.engine.request import Request
from kvforge.engine.sampler import SampleResult
from kvforge.engine.stop import StopStringMatcher


@dataclass
class _Group:
    """What the caller's request id shares across its n samples."""

    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    metrics: RequestMetrics
    finals: dict[int, CompletionOutput]  # finished samples' last completion, by sample index
    evicted: dict[int, tuple[int, int]] | None = None  # KV eviction: (tokens, blocks) evicted, by sample index
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # by prompt position (None at 0)


@dataclass
class _State:
    """One sample's incremental text, stop matcher and logprobs."""

    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    emitted_text: str = ""
    emitted_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_text: str | None = None
    visible: str = ""  # text the caller may see now (held-back stop-string prefixes excluded)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}  # by sample (request) id
        self.groups: dict[str, _Group] = {}  # by the caller's request id

    def add(self, req: Request, prompt: str | None) -> None:
        self.groups[req.request_id] = _Group(
            prompt, list(req.prompt_token_ids), req.num_seqs, RequestMetrics(req.arrival_time), {},
            prompt_logprobs=[None] * req.num_prompt_tokens if req.sampling_params.prompt_logprobs is not None else None,
        )
        self._add_sample(req)

    def fork(self, children: list[Request]) -> None:
        """Start output state for samples 1..n-1 of a request whose prompt was just forked."""
        for child in children:
            self._add_sample(child)

    def _add_sample(self, req: Request) -> None:
        p = req.sampling_params
        detok = (
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        stops = StopStringMatcher(p.stop_strings, p.include_stop_str_in_output) if p.stop_strings and detok is not None else None
        self.states[req.request_id] = _State(
            detok, stops,
            logprobs=[] if p.logprobs is not None else None,
            cumulative_logprob=0.0 if p.logprobs is not None or p.num_samples > p.n else None,
        )

    def record_prompt_scores(self, request_id: str, scores: PromptScores) -> None:
        """Prompt logprobs one prefill chunk scored; stored by position, so a recompute after preemption overwrites."""
        group = self.groups.get(request_id)
        if group is not None and group.prompt_logprobs is not None:
            group.prompt_logprobs[scores.first: scores.first + len(scores.entries)] = scores.entries

    def process(self, req: Request, result: SampleResult) -> tuple[CompletionOutput, bool]:
        """Record the token sample `req` just got; returns its completion and whether a stop string matched."""
        st = self.states[req.request_id]
        metrics = self.groups[req.group_id].metrics
        now = time.monotonic()
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_scheduled_time = req.first_scheduled_time
        metrics.last_token_time = now
        if st.logprobs is not None and result.logprob is not None:
            top = dict(result.top_logprobs or {})
            top[result.token_id] = result.logprob
            st.logprobs.append(top)
        if st.cumulative_logprob is not None and result.logprob is not None:
            st.cumulative_logprob += result.logprob
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
        return self._completion(req, finished=req.is_finished or stop_hit), stop_hit

    def collect(self, advanced: list[tuple[Request, CompletionOutput]]) -> list[RequestOutput]:
        """One RequestOutput per caller request that advanced, in first-advance order.

        It holds the completions that advanced this step; once every sample has finished it is
        the final output, carrying all n completions in index order.
        """
        by_group: dict[str, list[CompletionOutput]] = {}
        reqs: dict[str, Request] = {}
        for req, completion in advanced:
            by_group.setdefault(req.group_id, []).append(completion)
            reqs.setdefault(req.group_id, req)
        return [self._request_output(gid, reqs[gid], comps) for gid, comps in by_group.items()]

    def _request_output(self, gid: str, req: Request, completions: list[CompletionOutput]) -> RequestOutput:
        g = self.groups[gid]
        finished = len(g.finals) >= g.n
        if finished:
            g.metrics.finished_time = time.monotonic()
            completions = [g.finals[i] for i in sorted(g.finals)]
            if req.sampling_params.num_samples > req.sampling_params.n:  # best_of: the n most likely, reindexed
                best = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[: req.sampling_params.n]
                completions = [replace(c, index=i) for i, c in enumerate(best)]
            del self.groups[gid]
        return RequestOutput(gid, g.prompt, list(g.prompt_token_ids), sorted(completions, key=lambda c: c.index),
                             finished, req.num_cached_prompt_tokens, g.metrics, dict(req.cached_tokens_by_tier),
                             list(g.prompt_logprobs) if g.prompt_logprobs is not None else None)

    def _completion(self, req: Request, finished: bool) -> CompletionOutput:
        st = self.states[req.request_id]
        text = st.visible
        delta = text[len(st.emitted_text):]
        st.emitted_text = text
        new_tokens = req.output_token_ids[st.emitted_tokens:]
        st.emitted_tokens = req.num_output_tokens
        reason = None
        if finished:
            reason = "stop" if (st.stop_text is not None or req.status.value == "stop") else req.status.value
            self.states.pop(req.request_id, None)
        completion = CompletionOutput(
            index=req.sample_index, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=st.cumulative_logprob, logprobs=list(st.logprobs) if st.logprobs is not None else None,
            finish_reason=reason, stop_reason=req.stop_reason, delta_text=delta, delta_token_ids=list(new_tokens),
        )
        group = self.groups[req.group_id]
        if req.evicted_blocks_total:  # KV eviction: what every sample evicted so far, summed
            group.evicted = group.evicted or {}
            group.evicted[req.sample_index] = (req.evicted_tokens_total, req.evicted_blocks_total)
            group.metrics.num_evicted_tokens = sum(t for t, _ in group.evicted.values())
            group.metrics.num_evicted_blocks = sum(b for _, b in group.evicted.values())
        if finished:
            group.finals[req.sample_index] = completion
            group.metrics.num_preemptions += req.num_preemptions
        return completion

    def abort(self, request_id: str, samples: list[Request]) -> RequestOutput | None:
        """Finish the live `samples` of caller request `request_id` as aborted; its final output."""
        if request_id not in self.groups:
            return None
        if not samples:
            del self.groups[request_id]
            return None
        for req in samples:
            if req.request_id in self.states:
                self._completion(req, finished=True)
        g = self.groups[request_id]
        g.n = len(g.finals)  # samples never forked do not exist: the output holds those that did
        return self._request_output(request_id, samples[0], [])
