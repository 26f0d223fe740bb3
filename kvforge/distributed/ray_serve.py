"""kvforge replicas on Ray Serve, routed by what each replica really has in its KV cache.

Two deployments (optional extra `kvforge[ray]`):
- `KVForgeIngress` (one replica, no CPU reserved): the OpenAI API of `kvforge serve`. It validates a
  request (400 naming the field, as the single server does), tokenizes the prompt once, computes its
  block hash chain (`kvforge.kv.hashing`, the replicas' own) and calls the server deployment.
- `KVForgeServer` (N replicas, 1 CPU each): one kvforge engine each, serving requests with the same
  code as `kvforge serve` (`OpenAIServing`). `record_routing_stats` (polled by Ray Serve) reports the
  block hashes its prefix index holds, its running/waiting requests, KV utilisation and hit counters.

Routing uses Ray Serve's request-router API: `KVAffinityRequestRouter` runs inside the ingress's
deployment handle. It turns each replica's reported hash set into stored/evicted events (diff with
the previous report) for the torch-free `KVAffinityRouter` and ranks the replica holding the longest
prefix first, unless it is overloaded (thresholds: `RouterConfig`). Dead replicas leave the candidate
set (Ray Serve reports them) and their blocks with them. `/metrics` on the ingress adds per-replica hit
rates and the routing decisions (affinity, load fallback, no prefix) to Prometheus text.

Loopback by default: `kvforge serve --replicas N` starts a local Ray bound to 127.0.0.1 with the
dashboard and usage stats off; `--ray-address auto` joins an existing cluster instead.
"""

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvforge.distributed.router import Decision, KVAffinityRouter, RouterConfig
from kvforge.kv.hashing import extend_block_hashes
from kvforge.server.app import DEFAULT_MAX_REQUEST_BYTES, read_json
from kvforge.server.metrics import CONTENT_TYPE
from kvforge.server.protocol import APIError, GenerationRequest, parse_chat_request, parse_completion_request

HASH_BYTES = 16  # hashes travel truncated: routing only; the engine confirms every hit by token ids
ROUTERS: list["KVAffinityRequestRouter"] = []  # routers living in this process (the ingress's handle)
REPLICA_HEADER = "x-kvforge-replica"


def routing_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    return [h[:HASH_BYTES] for h in extend_block_hashes([], token_ids, block_size, (cache_salt,) if cache_salt else ())]


def load_tokenizer(model: str | None) -> Any:
    """The model's tokenizer without its weights (the front only tokenizes)."""
    from kvforge.models.loader import DEFAULT_MODEL_NAME, default_model_path
    from kvforge.tokenizer import Tokenizer

    path = default_model_path() if model in (None, DEFAULT_MODEL_NAME) else os.fspath(model)  # type: ignore[arg-type]
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    from kvforge.gguf_file import GGUFFile

    return Tokenizer.from_gguf(GGUFFile(path))


# ---- the request router (runs in the process holding the deployment handle) --------------------

class KVAffinityRequestRouter(RequestRouter):
    """Ray Serve request router: the replica holding the longest block-hash prefix, within a load guard."""

    def initialize_state(self, max_load_ratio: float = RouterConfig.max_load_ratio,
                         max_load_diff: float = RouterConfig.max_load_diff,
                         pending_ttl: float = RouterConfig.pending_ttl, stats_period_s: float = 0.5) -> None:
        self.kv = KVAffinityRouter(RouterConfig(max_load_ratio, max_load_diff, pending_ttl))
        self.reported: dict[str, tuple[Any, set]] = {}  # replica -> (stats version, hashes)
        self.replica_stats: dict[str, dict] = {}
        self.inflight_decisions: dict[int, tuple[Decision, list[bytes]]] = {}
        self.stats_period_s = stats_period_s
        self._actors: dict[str, Any] = {}
        self._poller: asyncio.Task | None = None
        # Ray Serve pickles a request-router class by value, globals included: register with the live module
        from kvforge.distributed import ray_serve

        ray_serve.ROUTERS.append(self)
        logging.getLogger("ray.serve").info("kvforge KV-affinity request router ready (%s)", self.kv.config)

    def _ingest(self, rid: str, stats: dict | None) -> None:
        """One report of a replica: its hash set becomes stored/evicted events (diff with the last one)."""
        stats = stats or {}
        version = stats.get("version")
        if version is None or self.reported.get(rid, (None,))[0] == version or rid not in self.kv.replicas:
            return
        new = set(stats.get("hashes", ()))
        old = self.reported.get(rid, (None, set()))[1]
        self.kv.on_events(rid, stored=new - old, evicted=old - new)
        self.kv.on_load(rid, int(stats.get("running", 0)), int(stats.get("waiting", 0)),
                        float(stats.get("kv_usage", 0.0)))
        self.reported[rid] = (version, new)
        self.replica_stats[rid] = {k: v for k, v in stats.items() if k != "hashes"}

    def _sync(self, candidates: list[RunningReplica]) -> None:
        for replica in candidates:
            rid = replica.replica_id.unique_id
            self.kv.add_replica(rid)
            self._ingest(rid, replica.routing_stats)

    async def _poll_stats(self) -> None:
        """Ask every replica for its report each period. Ray Serve also collects `record_routing_stats`, but
        (2.60) hands the result to routers only when the replica set changes, too late for block events."""
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        while True:
            for replica in list((getattr(self, "curr_replicas", None) or {}).values()):
                rid = replica.replica_id.unique_id
                try:
                    actor = self._actors.get(rid)
                    if actor is None:
                        actor = self._actors[rid] = ray.get_actor(replica._replica_info.actor_name,
                                                                  namespace=SERVE_NAMESPACE)
                    stats = await asyncio.wait_for(actor.record_routing_stats.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - a dead or busy replica: Serve reports deaths separately
                    self._actors.pop(rid, None)
                    continue
                self.kv.add_replica(rid)
                self._ingest(rid, stats)
            await asyncio.sleep(self.stats_period_s)

    def refresh(self) -> None:
        """Fold in the replicas' latest reports without routing anything (for /metrics)."""
        replicas = getattr(self, "curr_replicas", None) or {}
        self._sync(list(replicas.values()))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_stats())
        self._sync(candidate_replicas)
        hashes = _request_hashes(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = self.kv.choose(hashes, exclude=[r for r in self.kv.replicas if r not in by_id])
        if pending_request is not None:
            self.inflight_decisions[id(pending_request)] = (decision, hashes)
        first = by_id[decision.replica]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        decision, hashes = self.inflight_decisions.pop(id(pending_request), (None, []))
        rid = replica_id.unique_id
        if decision is None:
            return
        if decision.replica != rid:  # Ray sent it elsewhere (the chosen one was full): account it there
            decision = Decision(rid, decision.kind, self.kv.prefix_match(rid, hashes) if rid in self.kv.replicas else 0)
        self.kv.record(decision, hashes)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self.kv.finished(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.kv.remove_replica(replica_id.unique_id)
        self._actors.pop(replica_id.unique_id, None)
        self.reported.pop(replica_id.unique_id, None)
        self.replica_stats.pop(replica_id.unique_id, None)


def _request_hashes(pending: PendingRequest | None) -> list[bytes]:
    """The block hashes the ingress attached to the call (third positional argument)."""
    if pending is None or len(pending.args) < 3 or not isinstance(pending.args[2], dict):
        return []
    return list(pending.args[2].get("block_hashes", ()))


# ---- the engine replicas ---------------------------------------------------------------------

@serve.deployment(ray_actor_options={"num_cpus": 1})
class KVForgeServer:
    """One kvforge engine, serving parsed OpenAI requests with `kvforge serve`'s own code."""

    def __init__(self, engine_kwargs: dict, model_name: str) -> None:
        from kvforge.engine.args import EngineArgs
        from kvforge.engine.engine import LLMEngine
        from kvforge.server.async_engine import AsyncEngine
        from kvforge.server.serving import OpenAIServing

        self.engine = AsyncEngine(LLMEngine(EngineArgs(**{"log_ledger": False, **engine_kwargs}))).start()
        self.serving = OpenAIServing(self.engine, model_name)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (tests of the class itself)
            self.replica_id = f"pid-{os.getpid()}"
        self.version = 0

    async def record_routing_stats(self) -> dict:
        """What the router needs, read on the engine thread between steps (a consistent view)."""
        def read(engine: Any) -> dict:
            stats = engine.kv.stats
            # group 0 anchors prefix hits (kvforge/kv/coordinator.py): its cached hashes are what a request can reuse
            return {"hashes": [h[:HASH_BYTES] for h in engine.kv.pools[0].cached], "running": len(engine.scheduler.running),
                    "waiting": len(engine.scheduler.waiting), "kv_usage": engine.pool.usage,
                    "prefix_queries": stats.queries, "prefix_hits": stats.hits}
        out = await self.engine.call(read)
        self.version += 1
        return {**out, "version": (self.replica_id, self.version), "replica": self.replica_id, "time": time.time()}

    def _parse(self, kind: str, body: Any) -> GenerationRequest:
        return parse_chat_request(body) if kind == "chat" else parse_completion_request(body)

    async def generate(self, kind: str, body: Any, routing: dict) -> dict:
        try:
            req = self._parse(kind, body)
            base, subs = self.serving.prepare(req)
            group = await self.serving.submit(req, subs)
            try:
                result = await self.serving.complete(req, base, subs, group)
            except BaseException:
                group.abort()
                raise
            return {"status": 200, "body": result, "replica": self.replica_id}
        except APIError as exc:
            return {"status": exc.status, "body": exc.body(), "replica": self.replica_id}

    async def generate_stream(self, kind: str, body: Any, routing: dict):  # type: ignore[no-untyped-def]
        """Yields the replica id first, then the SSE lines `kvforge serve` would send."""
        yield self.replica_id
        req = self._parse(kind, body)
        base, subs = self.serving.prepare(req)
        group = await self.serving.submit(req, subs)
        try:
            async for line in self.serving.stream(req, base, subs, group):
                yield line
        finally:
            group.abort()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the kvforge engine is not running")


# ---- the OpenAI front ------------------------------------------------------------------------

api = FastAPI(title="kvforge (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class KVForgeIngress:
    def __init__(self, server: Any, model: str | None, model_name: str, block_size: int) -> None:
        self.server, self.model_name, self.block_size = server, model_name, block_size
        self.tokenizer = load_tokenizer(model)  # the replicas' tokenizer: same ids, same hashes
        self.created = int(time.time())

    def _hashes(self, req: GenerationRequest) -> list[bytes]:
        from kvforge.server.serving import OpenAIServing

        prompts = OpenAIServing._tokenize(SimpleNamespace(tokenizer=self.tokenizer), req)  # type: ignore[arg-type]
        return routing_hashes(prompts[0][1], self.block_size) if prompts else []

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            body = await read_json(request, DEFAULT_MAX_REQUEST_BYTES)
            req = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
            routing = {"block_hashes": self._hashes(req)}
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        if req.stream:
            gen = self.server.options(stream=True).generate_stream.remote(kind, body, routing)
            replica = await gen.__anext__()

            async def lines():  # type: ignore[no-untyped-def]
                async for line in gen:
                    yield line
            return StreamingResponse(lines(), media_type="text/event-stream", headers={REPLICA_HEADER: replica})
        out = await self.server.generate.remote(kind, body, routing)
        return JSONResponse(out["body"], status_code=out["status"], headers={REPLICA_HEADER: out["replica"]})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    @api.get("/v1/models")
    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvforge"}
        return {"object": "list", "data": [card]}

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        # serve.ingress pickles this class when it is defined: reach the live module (and the routers that the
        # deployment handle created in this process) through an import, not through captured globals
        from kvforge.distributed import ray_serve

        text = ray_serve.render_router_metrics(ray_serve.ROUTERS)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)


class RouterMetricsCollector(Collector):
    """prometheus-client collector: routing decisions and, per replica, prefix-cache hit rate, load and routed
    requests, read from the routers at scrape time (as kvforge/server/metrics.py reads its gauges)."""

    def __init__(self, routers: list[KVAffinityRequestRouter]) -> None:
        self.routers = routers

    def collect(self) -> Iterator[Metric]:
        decisions: dict[str, int] = {}
        replicas: dict[str, dict] = {}
        for r in self.routers:
            r.refresh()
            for kind, n in r.kv.decisions.items():
                decisions[kind] = decisions.get(kind, 0) + n
            view = r.kv.stats()["replicas"]
            for rid, stats in r.replica_stats.items():
                replicas[rid] = {**stats, **view.get(rid, {})}
        fam = CounterMetricFamily("kvforge_router_decisions", "Requests routed, by decision "
                                  "(affinity, load_fallback, no_prefix).", labels=["decision"])
        for kind, n in sorted(decisions.items()):
            fam.add_metric([kind], n)
        yield fam
        yield GaugeMetricFamily("kvforge_router_replica_reports", "Replicas whose routing stats the routers have "
                                "received.", value=sum(len(r.reported) for r in self.routers))
        series = [
            (GaugeMetricFamily, "kvforge_replica_prefix_cache_hit_rate", "Prefix-cache hits / queries, as the replica "
             "reported.", lambda s: s.get("prefix_hits", 0) / s["prefix_queries"] if s.get("prefix_queries") else 0.0),
            (CounterMetricFamily, "kvforge_replica_routed_requests", "Requests this router sent to the replica.",
             lambda s: s.get("routed", 0)),
            (GaugeMetricFamily, "kvforge_replica_cached_blocks", "Block hashes the replica holds (router's view).",
             lambda s: s.get("blocks", 0)),
            (GaugeMetricFamily, "kvforge_replica_running", "Running requests, as last reported.",
             lambda s: s.get("running", 0)),
            (GaugeMetricFamily, "kvforge_replica_kv_usage", "KV cache utilisation, as last reported.",
             lambda s: s.get("kv_usage", 0)),
        ]
        for family, name, help_text, fn in series:
            fam = family(name, help_text, labels=["replica"])
            for rid, st in sorted(replicas.items()):
                fam.add_metric([rid], float(fn(st)))
            yield fam


def render_router_metrics(routers: list[KVAffinityRequestRouter]) -> str:
    """Prometheus text (format 0.0.4) of `routers`, rendered by prometheus-client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterMetricsCollector(routers))
    return generate_latest(registry).decode()


# ---- building and running the application -----------------------------------------------------

def build_app(engine_kwargs: dict, model_name: str, num_replicas: int = 2,
              router_kwargs: dict | None = None, stats_period_s: float = 0.5,
              router_class: Any = KVAffinityRequestRouter) -> Any:
    """The Serve application; `router_class=None` keeps Ray Serve's default (power of two choices)."""
    from ray.serve.config import RequestRouterConfig

    options: dict[str, Any] = {"num_replicas": num_replicas}
    if router_class is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class,
            request_router_kwargs=({"stats_period_s": stats_period_s, **(router_kwargs or {})}
                                   if router_class is KVAffinityRequestRouter else router_kwargs or {}),
            request_routing_stats_period_s=stats_period_s, request_routing_stats_timeout_s=max(5.0, stats_period_s),
        )
    server = KVForgeServer.options(**options).bind(engine_kwargs, model_name)
    return KVForgeIngress.bind(server, engine_kwargs.get("model"), model_name, int(engine_kwargs.get("block_size", 16)))


def app_builder(args: dict) -> Any:
    """For `serve run kvforge.distributed.ray_serve:app_builder model=PATH replicas=2 block_size=16 ...`."""
    args = dict(args)
    replicas = int(args.pop("replicas", 2))
    name = args.pop("served_model_name", None) or os.path.basename(str(args.get("model") or "SmolLM2-135M-Instruct"))
    router = {k: float(args.pop(k)) for k in ("max_load_ratio", "max_load_diff", "pending_ttl") if k in args}
    engine = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in args.items()}
    return build_app(engine, name, replicas, router)


def init_local_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address` ("auto": the running cluster), or start a local Ray bound to loopback, no dashboard."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    # On Linux Ray rewrites a loopback node address into the host's routable one (resolve_ip_for_localhost),
    # so the raylet and dashboard agent would listen there; this flag keeps a local cluster on 127.0.0.1.
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s to register: an overloaded host can miss it
        try:
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus, log_to_driver=False)
            return
        except Exception as exc:  # noqa: BLE001 - ray raises a bare Exception for this
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()


def run_replicas(args: Any, engine_kwargs: dict, model_name: str) -> int:
    """`kvforge serve --replicas N [--ray-address auto]`: deploy, print the URL, serve until interrupted."""
    init_local_ray(args.ray_address, None)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(engine_kwargs, model_name, args.replicas), name="kvforge", route_prefix="/")
    print(f"kvforge serve: '{model_name}' x {args.replicas} replicas (Ray Serve, KV-affinity routing) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


__all__ = ["KVAffinityRequestRouter", "KVForgeIngress", "KVForgeServer", "app_builder", "build_app",
           "render_router_metrics", "routing_hashes", "asyncio"]
