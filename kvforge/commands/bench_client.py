"""The load generator of `kvforge bench serve`: Poisson arrivals or fixed concurrency, streaming.

Each request streams from an OpenAI-compatible endpoint and records, on the
client's clock, when each content event arrived: TTFT is the first, ITL the
gaps between the rest. Token counts come from the final `usage` chunk.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvforge.commands.bench_datasets import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # seconds since the benchmark started

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class LoadConfig:
    base_url: str
    model: str
    chat: bool = False
    api_key: str | None = None
    request_rate: float = float("inf")  # requests/s, Poisson; inf = all at once
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    timeout: float = 600.0


def _payload(cfg: LoadConfig, req: BenchRequest) -> tuple[str, dict]:
    body: dict = {"model": cfg.model, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": req.prompt}]}
    return "/v1/completions", {**body, "prompt": req.prompt}


def _content(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:  # chat chunk
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def send_one(http: httpx.AsyncClient, cfg: LoadConfig, req: BenchRequest, t0: float) -> RequestResult:
    path, body = _payload(cfg, req)
    res = RequestResult(start=time.perf_counter() - t0)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.success = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))[:200]
                    return res
                now = time.perf_counter()
                if _content(chunk):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        res.latency = time.perf_counter() - start
        if res.success and res.output_tokens == 0:
            res.success, res.error = False, "the stream carried no usage (stream_options.include_usage ignored?)"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_load(cfg: LoadConfig, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send every request on schedule; returns the results (input order) and the wall time."""
    rng = random.Random(cfg.seed)
    limit = cfg.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    timeout = httpx.Timeout(cfg.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout) as http:
        t0 = time.perf_counter()

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await send_one(http, cfg, req, t0)

        tasks = []
        for i, req in enumerate(requests):
            if i and cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def poisson_gaps(rate: float, n: int, seed: int) -> list[float]:
    """The inter-arrival gaps run_load draws (exposed for tests): exponential with mean 1/rate."""
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]
