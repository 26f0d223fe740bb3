"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

Wires the pieces DESIGN.md names: scheduler -> model runner -> sampler ->
scheduler update -> incremental detokenization and stop strings. Synchronous;
the server drives it from its own loop.
"""
from __future__ import annotations

import itertools
import sys
import time
import weakref
from dataclasses import dataclass, replace

import torch

from kvforge import envs
from kvforge.attention import check_backend_device
from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS, label
from kvforge.config import ModelConfig, torch_dtype
from kvforge.engine.args import EngineConfig
from kvforge.engine.cuda_graphs import decode_graphs_for
from kvforge.engine.dtype_choice import resolve_dtype
from kvforge.engine.errors import EngineFatal, StepFailed
from kvforge.engine.gpu_memory import plan_for_engine, uses_gpu_memory_utilization
from kvforge.engine.kv_eviction import EvictionTracker, check_eviction_supported
from kvforge.engine.logits_processors import bad_words_token_ids
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.output_processor import OutputProcessor
from kvforge.engine.rotation_calibration import auto_rotation_caches, calibrate_rotation, describe_rotation
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.request_check import RequestLimits, check_request
from kvforge.engine.kv_map import KVMapObserver
from kvforge.engine.scheduler import Scheduler, SchedulerOutput
from kvforge.engine.structured.manager import StructuredOutputManager
from kvforge.engine.startup_report import StartupReport, build_startup_report, describe_kv_dtype
from kvforge.engine.calibration import calibrate_static_scales
from kvforge.kv.storage.build import make_layer_caches
from kvforge.kv.contiguous import make_coordinator
from kvforge.kv.eviction import group_evicts
from kvforge.kv.salt import check_cache_salt
from kvforge.kv.tiers.tiers import flush_tiers_at_exit
from kvforge.kv.utilization import KVUtilizationStats, stored_after_step
from kvforge.ledger import num_blocks_for_memory, split_kv_blocks, tensor_parallel_kv
from kvforge.models.linear import pack_linear_weights
from kvforge.models.weight_pages import WeightPages, settle_weight_pages
from kvforge.models.registry import build_model
from kvforge.models.weight_stream import load_into, parameters_on_meta
from kvforge.progress import StageProgress


@dataclass
class EngineCounters:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_evicted_tokens: int = 0  # KV eviction, all requests
    num_evicted_blocks: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvforge.models.loader import DEFAULT_MODEL_NAME, load_checkpoint

        self.config = config
        opts = config.model_options
        # the weights stream in block by block (models/weight_stream.py): reading, converting and quantizing
        # interleave, and each stage's line counts its own seconds
        stages = ["reading headers", "building model", "reading weights", "converting weights",
                  "packing linear layers", "moving weights onto fresh pages", "allocating the KV pool"]
        calibrating = opts.quantization_calibration_tokens > 0  # GPTQ: the dense weights first, codes after
        quantize_stage = stages.index("packing linear layers")  # quantizing comes just before packing
        if calibrating:
            stages.insert(quantize_stage, f"fitting {opts.quantization} codes by GPTQ on "
                                          f"{opts.quantization_calibration_tokens} calibration tokens")
        elif opts.quantization:
            stages.insert(quantize_stage, "attaching the GGUF file's codes" if opts.quantization == "gguf"
                          else f"attaching the {label(opts.quantization)} checkpoint's codes"
                          if opts.quantization in CHECKPOINT_QUANT_METHODS
                          else f"quantizing linear layers to {opts.quantization}")
        with StageProgress(f"loading {opts.model or DEFAULT_MODEL_NAME}", stages, quiet=not config.log_ledger) as p:
            checkpoint = load_checkpoint(opts.model)
            p.next()
            self.tokenizer = checkpoint.tokenizer
            self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
            self.device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            check_backend_device(opts.attention_backend, self.device.type)  # e.g. triton on CPU, no interpreter
            dtype, self.dtype_reason = resolve_dtype(opts.dtype, self.device, checkpoint.hf_config, checkpoint.weights)
            if self.device.type == "cpu":  # first run: the C kernels compile while the weights load
                prebuild_cpu_kernels(dtype, opts.quantization, attention_group(checkpoint.hf_config))
            self.config = config = config.replace(dtype=dtype)  # everything below sees the concrete dtype
            opts = config.model_options
            self.executor = None
            self.weight_pages: WeightPages | None = None  # set where this process holds the weights on the CPU
            if config.parallel_config.tensor_parallel_size > 1:  # the ranks load their own shards (kvforge/distributed)
                from kvforge.engine.parallel.executor import TensorParallelExecutor

                del checkpoint
                self.model = None
                self.model_fingerprint = None  # KV tiers are refused with tensor parallelism (EngineConfig)
                self.executor = TensorParallelExecutor(config, self.model_config)  # ranks build, shard and pack
                for _ in stages[1:-1]:
                    p.next()
            else:
                with parameters_on_meta():  # no bytes yet: each parameter gets its own as it is read
                    model = build_model(self.model_config).to(dtype=torch_dtype(opts.dtype))
                p.next()
                times = load_into(model, checkpoint.source, torch_dtype(opts.dtype),
                                  None if calibrating else opts.quantization, opts.quantization_group_size,
                                  checkpoint.path, self.device)
                checkpoint_path = checkpoint.path
                del checkpoint
                self.model = model.to(device=self.device).eval()
                p.split([times.read, times.convert] + ([times.quantize] if opts.quantization and not calibrating else []))
                if calibrating:
                    self._calibrate_quantized_weights(checkpoint_path)
                    if self.calibration.cached_from is not None:
                        p.stages[quantize_stage] = "reading the fitted codes from the cache"
                    p.next()
                from kvforge.kv.tiers.setup import model_fingerprint

                self.model_fingerprint = model_fingerprint(self.model)  # the KV tiers' namespace; taken before packing
                pack_linear_weights(self.model)  # CPU: weights re-laid out once for oneDNN (models/linear.py)
                p.next()
                # CPU: the packed weights leave the scattered pages loading left them on (models/weight_pages.py)
                self.weight_pages = (settle_weight_pages(self.model, envs.KVFORGE_WEIGHT_PAGES)
                                     if self.device.type == "cpu" else None)
                p.next()
            self._init_cache_and_scheduler(p)

    def _calibrate_quantized_weights(self, checkpoint_path: str) -> None:
        """`quantization_calibration_tokens`: run the calibration text through the dense model on a pool of its
        own, fit the int4 codes (engine/weight_calibration.py; or read them from its cache, keyed by the files
        at `checkpoint_path` and the options), then drop that pool: the serving pool is built after, for the
        quantized weights."""
        from kvforge.engine.weight_calibration import calibrate_quantized_weights

        opts, serving = self.config.model_options, self.config
        # the throwaway pool: no ledger printed, no KV tiers (nothing the dense weights computed is kept)
        self.config = serving.replace(log_ledger=False, kv_offload_memory=None, kv_disk_cache=None)
        try:
            self._init_cache_and_scheduler()
            self.calibration = calibrate_quantized_weights(
                self, str(opts.quantization), opts.quantization_group_size, opts.quantization_calibration_tokens,
                opts.quantization_calibration_file, checkpoint_path)
            if serving.log_ledger:
                print(f"kvforge: {self.calibration.describe()}", file=sys.stderr, flush=True)
        finally:
            self.close()
            self.config = serving
            self.kv = self.runner = self.scheduler = None  # type: ignore[assignment]

    def _init_cache_and_scheduler(self, progress: StageProgress | None = None) -> None:
        config, cfg = self.config, self.model_config
        opts, cache_cfg, sched = config.model_options, config.cache_config, config.scheduler_config
        self.cache_format = cache_cfg.cache_format(opts.dtype)
        shape = cfg.kv_shape()
        if self.executor is not None:  # one device's share: its own KV heads (replicated when too few)
            shape = tensor_parallel_kv(shape, config.parallel_config.tensor_parallel_size).per_device
        kv_memory, self.gpu_memory = cache_cfg.kv_cache_memory or 0, None
        if uses_gpu_memory_utilization(cache_cfg, self.device, self.executor is not None):
            self.gpu_memory = plan_for_engine(self)  # profiled: gpu_memory_utilization's share, as vLLM
            kv_memory = self.gpu_memory.kv_bytes
        num_blocks = cache_cfg.num_kv_blocks or num_blocks_for_memory(
            kv_memory, shape, cache_cfg.block_size, self.cache_format
        )
        max_model_len = sched.max_model_len or cfg.max_position_embeddings
        self.scheduler_config = replace(sched, max_model_len=max_model_len)
        # One pool per KV cache group (a plain model: one) in the memory of `num_blocks` single-table
        # blocks, each pool's null block included.
        groups = split_kv_blocks(shape, self.cache_format, cache_cfg.block_size, num_blocks,
                                 sched.max_num_seqs, sched.max_num_batched_tokens)
        if min(g.num_blocks for g in groups) < 1:
            what = (f"num_kv_blocks={num_blocks}" if cache_cfg.num_kv_blocks
                    else f"kv_cache_memory={cache_cfg.kv_cache_memory} bytes")
            raise ValueError(f"{what} holds no usable block of this model's KV cache (each pool reserves a null block)")
        # kv_allocation="contiguous": every sequence reserves max_model_len slots at admission (naive baseline)
        self.kv = make_coordinator(groups, cache_cfg.block_size, cache_cfg.enable_prefix_caching,
                                   cache_cfg.kv_allocation, max_model_len)
        self.kv_usage = KVUtilizationStats()  # tokens stored / slots allocated, measured every step
        self.kv_map = KVMapObserver()  # the live block map's events and snapshots (/kv, kvforge top)
        self.pool = self.kv.pool
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
        layer_groups = [group_of[i] for i in range(cfg.num_layers)]
        self.outputs = OutputProcessor(self.tokenizer)
        self.samples: dict[str, list[Request]] = {}  # caller's request id -> its live samples (n > 1: forks)
        self.counters = EngineCounters()
        self._ids = itertools.count()
        if self.executor is not None:
            from kvforge.engine.parallel.setup import init_tensor_parallel_caches

            self.runner, self.report = init_tensor_parallel_caches(
                self.executor, config, cfg, self.cache_format, groups, layer_groups,
                [self.kv.pools[g].num_physical_blocks for g in layer_groups], max_model_len)
            if progress is not None:
                progress.next()
        else:
            caches = make_layer_caches(
                cfg, self.cache_format, [self.kv.pools[g].num_physical_blocks for g in layer_groups],
                cache_cfg.block_size, self.device, torch_dtype(opts.dtype),
            )
            if progress is not None:
                progress.next()
            self.runner = ModelRunner(self.model, caches, layer_groups, cache_cfg.block_size, self.device, opts.seed,
                                      opts.attention_backend, [group_evicts(g.window) for g in groups])
            self.runner.decode_graphs = decode_graphs_for(self.model, caches, self.device, opts.enforce_eager,
                                                          sched.max_num_seqs, max_model_len, cache_cfg.block_size,
                                                          opts.attention_backend)
            self.report: StartupReport = build_startup_report(
                self.model, cfg, self.cache_format, groups, cache_cfg.block_size, max_model_len, caches, config
            )
        self.structured = self.runner.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size)
        self.eviction: EvictionTracker | None = None
        if config.eviction_config.enabled:  # refused with tensor parallelism (EngineConfig)
            check_eviction_supported(cfg)
            self.eviction = EvictionTracker(config.eviction_config, self.kv)
        self.report.dtype_reason = self.dtype_reason
        if self.weight_pages is not None:
            self.report.weight_pages = self.weight_pages.describe()
        if self.gpu_memory is not None:
            self.report.kv_sizing = self.gpu_memory.describe()
        if self.executor is None and auto_rotation_caches(caches):  # kv_cache_rotation="auto": measured per layer
            calibrate_rotation(self)
            self.report.kv_dtype = describe_kv_dtype(self.cache_format, describe_rotation(caches))
        if config.log_ledger:
            print(self.report.render(), file=sys.stderr, flush=True)
        calibrate_static_scales(self)  # kv_cache_scale="tensor" only: fix the static scales on real text
        self.tiers = None
        if config.tier_config.enabled:
            self._init_tiers(caches, groups, cache_cfg.block_size)

    def _init_tiers(self, caches: list, groups: list, block_size: int) -> None:
        """Host/disk tiers below the block pool (kvforge.kv.tiers), after calibration fixed any static scales."""
        from kvforge.kv.tiers.cost import SwapCost
        from kvforge.kv.tiers.setup import build_tiers, ledger_rows, measure_prefill_rate

        tiers, mover = build_tiers(caches, self.model_fingerprint, self.cache_format, block_size,
                                   self.pool.num_blocks, self.config.tier_config, self.device)
        n = min(256, (self.pool.num_blocks - 1) * block_size, self.scheduler_config.max_model_len - 1)
        rate = measure_prefill_rate(self.prompt_logits, max(n, 1), self.model_config.vocab_size)
        self.kv.reset_prefix_cache()  # the measuring prompt is no prefix anyone will reuse
        tiers.swap_cost = SwapCost(tiers.copy_bytes_per_s, rate, mover.block_nbytes, block_size)
        self.kv.attach_tiers(tiers)
        self.runner.attach_tiers(tiers, mover)
        self.tiers = tiers
        # a script that ends without close() still writes its cached prefixes (at exit or when collected)
        self._tier_finalizer = weakref.finalize(self, flush_tiers_at_exit, tiers, mover, self.kv)
        self.report.tiers = ledger_rows(tiers, mover.block_nbytes, block_size)
        if self.config.log_ledger:
            print("\n".join(f"  {k:<18}  {v}" for k, v in self.report.tiers), file=sys.stderr, flush=True)

    def close(self) -> None:
        """Write the device's cached prefix blocks to the KV tiers and wait for the disk.

        A restarted engine on the same kv_disk_cache then serves every prefix this one had cached,
        not only the ones the pool happened to evict. A no-op without tiers.
        """
        if self.tiers is None:
            return
        self._tier_finalizer()  # runs once: a later close() or the exit hook does nothing more

    def abandon_tiers(self) -> None:
        """The engine broke (or its thread is stuck): no exit flush of the device's blocks; the tiers keep
        what completed steps wrote."""
        if self.tiers is not None:
            self._tier_finalizer.detach()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per-tier counters (hits/queries in tokens, bytes, load time, evictions); empty without tiers."""
        return self.tiers.snapshot() if self.tiers is not None else {}

    def reconfigure_kv_cache(self, **changes: object) -> None:
        """Rebuild pool, manager, scheduler and runner with changed engine options (e.g. kv_cache_dtype), keeping the
        loaded weights: how `kvforge eval kv-quant` compares cache formats without reloading the model."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot reconfigure the KV cache while requests are running")
        self.close()  # the KV tiers are rebuilt with the new pool (a new KV format is a new tier namespace)
        self.config = self.config.replace(**changes)
        self._init_cache_and_scheduler()

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; bad input raises ValueError and leaves the engine untouched."""
        params = params or SamplingParams()
        cache_salt = check_cache_salt(cache_salt)  # tenant isolation: a bad salt is refused, never hashed
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        self.check_request(prompt_token_ids, params)
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("bad_words needs a tokenizer; this engine has none")
            params = replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.samples:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else self.model_config.eos_token_ids
        # n > 1: one request prefills the prompt once, then forks into n samples sharing its blocks.
        req = Request(request_id, list(prompt_token_ids), params, eos, cache_salt, num_seqs=params.num_samples,
                      kv_budget=self._kv_budget(params))
        self.structured.add(req)  # a bad constraint raises here, before anything is queued
        self.scheduler.add_request(req)
        self.outputs.add(req, prompt)
        self.samples[request_id] = [req]
        return request_id

    def _kv_budget(self, params: SamplingParams) -> int | None:
        """The request's eviction budget: its own `kv_budget` (checked by check_request) or the engine's."""
        cfg = self.config.eviction_config
        if not cfg.enabled:
            return None
        return cfg.kv_budget if params.kv_budget is None else params.kv_budget

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for: the effective context length, vocabulary, batch width and KV budget."""
        return RequestLimits(self.scheduler_config.max_model_len, self.scheduler.max_seq_len,
                             self.model_config.vocab_size, self.scheduler_config.max_num_seqs, self.kv.block_size,
                             self.config.eviction_config)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      strict_max_tokens: bool = False) -> int:
        """The single admission check (LLM, CLI and server alike): RequestRejected (a ValueError naming the
        field) or the number of new tokens that fit after the prompt. Reads only immutable limits, so the
        server may call it off the engine thread."""
        return check_request(list(prompt_token_ids), params, self.limits, strict_max_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and, with n > 1, every one of its samples."""
        samples = self.samples.pop(request_id, None)
        if samples is None:
            return False
        for req in samples:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
            self._release(req.request_id)
        self.outputs.abort(request_id, samples)
        self.kv_usage.pop_request(request_id)
        self.counters.num_requests_aborted += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.samples)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled step. If running it fails, StepFailed names the caller requests it held, so a
        server can fail just those and keep serving (their blocks are freed by abort_request)."""
        sched_out = self.scheduler.schedule()
        try:
            return self._run_step(sched_out)
        except EngineFatal:
            raise
        except Exception as exc:
            self.kv.discard_unwritten()  # a no-op once the step's update ran: its blocks were written
            ids = list(dict.fromkeys(c.request.group_id for c in sched_out.chunks))
            raise StepFailed(ids) from exc

    def _run_step(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        for chunk in sched_out.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        for chunk in sched_out.chunks:
            if chunk.forks:
                self.samples[chunk.request.group_id].extend(chunk.forks)
                self.outputs.fork(chunk.forks)
                self.structured.fork(chunk.request, chunk.forks)
        if self.eviction is not None:  # scored policies: which rows' attention mass the runner returns
            sched_out.attention_scoring = self.eviction.scoring_for(sched_out.chunks)
        ran = self.runner.execute(sched_out)
        results = ran.sampled
        for rid, scores in ran.prompt_scores.items():  # SamplingParams.prompt_logprobs
            self.outputs.record_prompt_scores(rid, scores)
        self.kv_map.after_step(sched_out, self)
        if self.eviction is not None:
            self.eviction.collect(ran.attention_mass, sched_out.chunks)
        self.kv_usage.observe(self.kv, *stored_after_step(self.scheduler.running, sched_out.chunks))
        self.counters.num_steps += 1
        self.counters.num_prompt_tokens += sum(
            min(c.num_tokens, max(0, c.request.num_prompt_tokens - c.start)) for c in sched_out.chunks
        )
        sampled = {rid: r.token_id for rid, r in results.items()}
        advanced = self.scheduler.update(sched_out, sampled)
        if self.tiers is not None:  # write-through: the blocks this step cached leave now, not at the next step
            self.tiers.sync(self.runner.mover, self.kv.take_block_exports())
        if self.eviction is not None:
            for req in sched_out.preempted:  # recompute starts over: scores go with the blocks
                self.eviction.release(req.request_id)
            for req in advanced:  # caught up with its tokens: cut to the budget (the prompt once, then a block at a time)
                dropped = self.eviction.evict_if_due(req)
                evicted = len(dropped[0])  # logical blocks, in group 0 (the full-attention group eviction cuts)
                self.kv_map.on_evict(req, dropped, self.config.eviction_config.kv_eviction)
                self.counters.num_evicted_blocks += evicted
                self.counters.num_evicted_tokens += evicted * self.kv.block_size
        self.counters.num_generation_tokens += len(advanced)
        completions = []
        for req in advanced:
            if self.structured.advance(req) and not req.is_finished:  # the grammar is complete
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            completion, stop_hit = self.outputs.process(req, results[req.request_id])
            if stop_hit and not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                self._release(req.request_id)
                self.samples[req.group_id].remove(req)
            completions.append((req, completion))
        outputs = self.outputs.collect(completions)
        for out in outputs:
            if out.finished:
                del self.samples[out.request_id]
                if out.metrics is not None:
                    out.metrics.set_kv_usage(self.kv_usage.pop_request(out.request_id))
                self.counters.num_requests_finished += 1
        return outputs

    def _release(self, request_id: str) -> None:
        self.runner.release(request_id)
        self.structured.release(request_id)
        if self.eviction is not None:
            self.eviction.release(request_id)

    # ---- utilities ------------------------------------------------------------------------
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits for every prompt position through the paged path (used by tests and perplexity)."""
        req = Request(f"score-{next(self._ids)}", list(token_ids), SamplingParams())
        if self.kv.allocate_slots(req, len(token_ids)) is None:
            raise ValueError(f"{len(token_ids)} tokens do not fit in the KV cache")
        try:
            return self.runner.prompt_logits(req, self.kv.block_ids(req.request_id), self.kv.take_block_exports())
        finally:
            self.kv.free(req)

    def reset_prefix_cache(self) -> None:
        if not self.kv.reset_prefix_cache():
            raise RuntimeError(
                f"cannot reset the prefix cache while {self.pool.num_blocks - self.pool.num_free_blocks} "
                "blocks are in use; wait for running requests to finish or abort them"
            )

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done when the engine is garbage collected)."""
        if self.executor is not None:
            self.executor.shutdown()

    def check_integrity(self) -> None:
        self.kv.check_integrity()


def attention_group(hf_config: dict) -> int | None:
    """Query heads per KV head as the CPU attention kernels will see them (MLA: every head on its one
    latent row), or None when the config does not say."""
    cfg = hf_config.get("text_config") or hf_config
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv_heads = 1 if cfg.get("kv_lora_rank") else cfg.get("num_key_value_heads") or heads
    return heads // kv_heads if isinstance(kv_heads, int) and kv_heads >= 1 and heads % kv_heads == 0 else None


def prebuild_cpu_kernels(dtype: str, quantization: str | None, group: int | None = None) -> None:
    """Compile the C kernels a CPU model of `dtype` (a torch dtype's name) and weight `quantization` runs (kvforge/native) side by
    side, in the background.

    Only those: on a 2-core machine every library compiled now delays the ones the first step waits on, so
    the fp32 panel kernel is left out of a bf16 run, the int8/int4 linear kernel out of an unquantized one,
    and the attention kernels are cloned for the model's `group` (query heads per KV head) alone (each
    other piece still builds on its first use, should a later engine in the process need it)."""
    from kvforge.attention import cpu_kernel
    from kvforge.kv import quant_kernel
    from kvforge.models import decode_layers, fused, panel_linear, quant_linear
    from kvforge.native import prebuild

    libraries = [cpu_kernel.library_for(group), fused.LIBRARY, decode_layers.LIBRARY, quant_kernel.LIBRARY]
    if quantization:
        libraries.append(quant_linear.LIBRARY)
    if dtype in ("float32", "bfloat16"):
        libraries.append(panel_linear.LIBRARY if dtype == "float32" else panel_linear.LIBRARY_BF16)
    prebuild(*libraries)
