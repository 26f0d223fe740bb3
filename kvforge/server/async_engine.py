"""AsyncEngine: one thread owns the synchronous LLMEngine; asyncio handlers talk to it by message.

The engine is single-threaded by design, so nothing but the engine thread
calls step/add_request/abort_request. HTTP handlers post commands into a
thread-safe inbox, which the engine thread drains before every step; each
step's outputs go back to the asyncio loop that asked, into one queue per API
request (a group of n sub-requests), via `loop.call_soon_threadsafe`. A
handler that stops listening (client gone) posts an abort, so the request's
blocks are freed at the next step.

One request's failure never stops the loop: if a step raises, the engine names the
requests it held (`StepFailed`), those are failed alone (logged, blocks freed) and the
loop goes on. Only when the engine itself is broken (its KV pool fails its integrity
check, or several steps in a row fail) does the loop stop, and then `on_fatal` runs so
the process can exit non-zero for its supervisor instead of answering 503 forever.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine.engine import LLMEngine, StepFailed
from kvforge.engine.outputs import RequestOutput
from kvforge.kv.utilization import measure_running
from kvforge.server.metrics import ServerMetrics
from kvforge.server.request_group import (
    EngineDeadError, RequestFailedError, RequestGroup, ServerBusyError, SubRequest, resolve_future,
)

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine, not a request, is what is broken

log = logging.getLogger("kvforge.server")


@dataclass
class _Track:
    """Per-sub-request timing, owned by the engine thread (for the latency histograms)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Inbox:
    items: deque = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_waiting_requests: int | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_waiting_requests = max_waiting_requests  # None: unbounded (vLLM's default)
        self.on_fatal = on_fatal  # called once, on the engine thread, if the engine cannot continue
        self._inbox = _Inbox()
        self._groups: dict[str, RequestGroup] = {}  # sub-request id -> group; engine thread only
        self._tracks: dict[str, _Track] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False  # set on SIGTERM: no new requests, running ones may finish
        self.paused = False  # pause_generation(): no steps; commands (adds, aborts, calls) are still served
        self.error: BaseException | None = None
        self._pending = 0  # sub-requests posted but not yet queued in the engine (guarded by _inbox.cond)
        self._waiting = 0  # the engine's waiting queue as of the last step
        self._failed_steps = 0
        self.snapshot: dict[str, float] = {}
        self._refresh_snapshot()

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._post(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            stuck, self._thread = self._thread.is_alive(), None
            if stuck:  # the engine thread still holds the pool: no flush behind its back
                log.warning("engine thread did not stop within %g s; KV tiers not flushed", timeout)
                return
        self._flush_tiers()

    def _flush_tiers(self) -> None:
        """KV tiers: the pool's cached prefix blocks to disk, so a restart serves them. Runs after the drain
        (lifecycle.DrainingServer) finished or failed every request and the engine thread stopped."""
        if self.error is not None:
            return  # the engine broke mid-step: its blocks are not trusted; the tiers keep what they had
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - shutting down: report, do not mask the exit
            log.exception("flushing the KV tiers failed")

    def fail_unfinished(self, message: str) -> None:
        """End every request still running with EngineDeadError(message): streams get an error event and
        `[DONE]` (the end of a graceful drain). Runs on the engine thread, between steps."""
        self._post(("fail_all", message))

    def pause_generation(self) -> None:
        """Stop stepping after the step in flight, keeping every request and its blocks (vLLM's name).

        The engine thread still serves `call`, so the KV map and integrity checks read a state that
        holds still: what a person (or a test) inspecting the cache mid-run wants."""
        self.paused = True
        self._post(("wake",))

    def resume_generation(self) -> None:
        self.paused = False
        self._post(("wake",))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Engine requests not yet finished, queued ones included (what a drain waits for)."""
        return len(self._groups) + self._pending

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission: in the engine's queue, plus posted and not yet taken."""
        return self._waiting + self._pending

    # ---- caller side (asyncio) ------------------------------------------------------------
    async def submit(self, subs: list[SubRequest]) -> RequestGroup:
        """Queue all sub-requests atomically: a ValueError for one withdraws them all."""
        self._check_alive()
        limit = self.max_waiting_requests
        with self._inbox.cond:
            if limit is not None and self.num_queued + len(subs) > limit:
                self.metrics.rejected("queue_full")
                raise ServerBusyError(f"the server is busy: {self.num_queued} requests are waiting and "
                                      f"--max-waiting-requests is {limit}; retry later")
            self._pending += len(subs)
        group = RequestGroup(self, subs)
        done: asyncio.Future[None] = group.loop.create_future()
        self._post(("add", group, done))
        await done
        return group

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (consistent reads, integrity checks)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._post(("call", fn, fut))
        return await fut

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort these sub-requests before its next step (frees their blocks)."""
        self._post(("abort", list(request_ids)))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error!r}")
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running")
        if self.draining:
            self.metrics.rejected("draining")
            raise EngineDeadError("the server is shutting down")

    def _post(self, cmd: tuple) -> None:
        with self._inbox.cond:
            self._inbox.items.append(cmd)
            self._inbox.cond.notify()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=self.paused or not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests() and not self.paused:
                    self._step()
                self._refresh_snapshot()
        except BaseException as exc:  # noqa: BLE001 - the engine cannot continue: report, stop, tell the owner
            log.exception("the engine cannot continue")
            self.error = exc
            self._fail_all(EngineDeadError("the engine stopped after an internal error"))
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        self._drain_inbox(block=False)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _step(self) -> None:
        """One engine step; a failure fails only the requests that step held, unless the engine itself broke."""
        try:
            outputs = self.engine.step()
        except StepFailed as exc:
            self._failed_steps += 1
            log.error("engine step failed; failing requests %s", exc.request_ids, exc_info=exc.__cause__)
            for rid in exc.request_ids:
                group = self._groups.get(rid)
                self._abort(rid)
                if group is not None:
                    group._put(RequestFailedError("internal error while generating this request "
                                                  "(details are in the server log)"))
            self.engine.check_integrity()  # raises (-> fatal) if the failure corrupted the KV pool
            if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise RuntimeError(f"{self._failed_steps} engine steps in a row failed") from exc
            return
        self._failed_steps = 0
        self._deliver(outputs)

    def _abort(self, rid: str) -> None:
        self._groups.pop(rid, None)
        self._tracks.pop(rid, None)
        if self.engine.abort_request(rid):
            self.metrics.finished("abort")

    def _drain_inbox(self, block: bool) -> None:
        with self._inbox.cond:
            if block and not self._inbox.items and not self._stopping:
                self._inbox.cond.wait(timeout=1.0)
            cmds = list(self._inbox.items)
            self._inbox.items.clear()
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                self._add(cmd[1], cmd[2])
            elif kind == "abort":
                for rid in cmd[1]:
                    self._abort(rid)
            elif kind == "fail_all":
                self._fail_all(EngineDeadError(cmd[1]))
            elif kind == "call":
                fut = cmd[2]
                try:
                    result, exc = cmd[1](self.engine), None
                except Exception as e:  # noqa: BLE001 - handed back to the caller
                    result, exc = None, e
                resolve_future(fut, result, exc)
        self._waiting = len(self.engine.scheduler.waiting)

    def _add(self, group: RequestGroup, done: asyncio.Future) -> None:
        added: list[str] = []
        with self._inbox.cond:
            self._pending -= len(group.subs)
        try:
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            for s in group.subs:
                self.engine.add_request(s.prompt, s.params, s.prompt_token_ids, request_id=s.request_id)
                added.append(s.request_id)
        except Exception as exc:  # noqa: BLE001 - ValueError is the user's; anything else too, for this group
            for rid in added:  # bad input loses nothing: withdraw what this group queued
                self.engine.abort_request(rid)
            if not isinstance(exc, (ValueError, EngineDeadError)):
                log.error("adding a request failed", exc_info=exc)
                exc = RequestFailedError("internal error while queueing this request (details are in the server log)")
            resolve_future(done, None, exc)
            return
        for rid in added:
            self._groups[rid] = group
            self._tracks[rid] = _Track(group.arrival)
        resolve_future(done, None, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            group = self._groups.get(out.request_id)
            track = self._tracks.get(out.request_id)
            if group is None or track is None:
                continue  # aborted by its caller in the meantime
            if any(c.delta_token_ids for c in out.outputs):
                if track.first_token is None:
                    track.first_token = now
                    self.metrics.ttft.observe(now - track.arrival)
                elif track.last_token is not None:
                    self.metrics.itl.observe(now - track.last_token)
                track.last_token = now
            if out.finished:
                self._groups.pop(out.request_id, None)
                self._tracks.pop(out.request_id, None)
                self._observe_finished(out, track, now)
            group._put(out)

    def _observe_finished(self, out: RequestOutput, track: _Track, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - track.arrival)
        n_out = max(len(c.token_ids) for c in out.outputs)
        if track.first_token is not None and n_out > 1:
            m.tpot.observe((now - track.first_token) / (n_out - 1))
        if out.metrics is not None and out.metrics.first_scheduled_time is not None:
            m.queue_time.observe(max(0.0, out.metrics.first_scheduled_time - track.arrival))
        m.finished(out.outputs[0].finish_reason or "stop")

    def _fail_all(self, exc: BaseException) -> None:
        groups = {id(g): g for g in self._groups.values()}
        for rid in list(self._groups):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be the thing that broke
                pass
        self._groups.clear()
        self._tracks.clear()
        for g in groups.values():
            g._put(exc)
        with self._inbox.cond:
            cmds = list(self._inbox.items)
            self._inbox.items.clear()
        for cmd in cmds:
            if cmd[0] == "add":
                with self._inbox.cond:
                    self._pending -= len(cmd[1].subs)
            if cmd[0] in ("add", "call"):  # both carry the caller's future third
                resolve_future(cmd[2], None, exc)

    def _refresh_snapshot(self) -> None:
        """Gauges and engine counters as of the last step, for /metrics (read from another thread)."""
        e = self.engine
        stats = e.kv.stats
        self.snapshot = {
            "blocks_total": e.pool.num_blocks,
            "blocks_free": e.pool.num_free_blocks,
            "usage": e.pool.usage,
            "running": len(e.scheduler.running),
            "waiting": self.num_queued,
            "preemptions": e.scheduler.num_preemptions,
            "prompt_tokens": e.counters.num_prompt_tokens,
            "generation_tokens": e.counters.num_generation_tokens,
            "prefix_queries": stats.queries,
            "prefix_hits": stats.hits,
            "evicted_tokens": e.counters.num_evicted_tokens,
            "evicted_blocks": e.counters.num_evicted_blocks,
            "max_waiting": -1 if self.max_waiting_requests is None else self.max_waiting_requests,
            "draining": int(self.draining),
            "tiers": e.tier_stats(),  # type: ignore[dict-item]  # KV tiers (host, disk): per-tier counters
            **e.kv_usage.as_dict(measure_running(e.kv, e.scheduler.running)),  # KV utilization gauges (issue 18)
        }
