"""`quantization_calibration_tokens`: int4 / w4a8 codes fitted to real activations (GPTQ) at load.

Why at load, through the engine: the codes depend on what each linear layer is fed, and the engine's own
prefill path (paged KV, its attention and kernels) is what produces that. The engine loads the dense weights
(no streaming quantization), runs the calibration text through `prompt_logits` with a hook on every layer to
quantize, sums each layer's x^T x, and hands it to `models/gptq.py`; the codes then replace the dense weight.

Layers go in passes of whole decoder layers, in model order, so the second moments held at once stay under
`HESSIAN_BUDGET_BYTES` (a 1B Llama's would be 5 GiB together). A pass sees the layers quantized by earlier
passes, as serving will, without running them again: after a pass is quantized, the prompts run once more up to
the next pass's first decoder layer and its inputs are kept (a few MiB); the next pass resumes there, the layers
before it skipped. Each forward stops once the pass's layers have seen the prompt: nothing after them (the later
layers, the logits over the whole vocabulary) is computed. So every decoder layer runs about twice in all.

The lm_head (int8 under int4 / w4a8, `quant_linear.layer_method`) is quantized as without calibration.

The calibration text defaults to docstrings of Python's standard library (of the Python that runs the engine, so
the codes can differ a little between Python versions): real English and code, and not the `pydoc_data.topics`
text `kvforge eval weights` measures perplexity on. A user's own text (their domain) is
`quantization_calibration_file`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.models import gptq, quant_linear
from kvforge.models.gptq import gptq_quantize
from kvforge.models.quant_linear import QuantWeight, layer_method, pack_codes, quantize
from kvforge.native import cache_root
from kvforge.models.weight_quant import attach_with_embedding, quantizable_layers
from kvforge.tokenizer import bos_prefix

HESSIAN_BUDGET_BYTES = 1 << 30  # fp32 x^T x of the layers one pass calibrates
CALIBRATION_WINDOW = 1024  # tokens per prompt (fewer when the pool or the context holds fewer)
_DOC_MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email",
                "fractions", "functools", "heapq", "http.client", "itertools", "json", "logging", "os", "pathlib",
                "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess",
                "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile")


@dataclass
class CalibrationReport:
    tokens: int  # calibration tokens each layer saw
    layers: int  # layers whose codes GPTQ chose
    passes: int  # 0: the codes were read from the cache
    seconds: float
    cached_from: str | None = None  # the cache file the codes were read from
    unseen: int = 0  # layers the calibration text never reached (MoE experts no token went to): the search's codes

    def describe(self) -> str:
        if self.cached_from is not None:
            return f"GPTQ codes of {self.layers} layers read from {self.cached_from} in {self.seconds:.1f} s"
        text = f"GPTQ on {self.tokens} calibration tokens, {self.layers} layers in {self.passes} pass(es), {self.seconds:.1f} s"
        if self.unseen:
            text += f"; {self.unseen} layers no calibration token reached kept the per-group search's codes"
        return text


def default_calibration_text() -> str:
    """Docstrings (over 200 characters) of the public classes and functions of `_DOC_MODULES`, in a fixed order."""
    docs = []
    with warnings.catch_warnings():  # typing's deprecated io / re aliases warn when their docstrings are read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in _DOC_MODULES:
            module = importlib.import_module(name)
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                if getattr(obj, "__module__", "") != name:
                    continue
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    docs.append(doc)
    return "\n\n".join(docs)


def calibration_windows(tokenizer: Any, num_tokens: int, window: int, text: str) -> list[list[int]]:
    """`num_tokens` tokens of `text` cut into prompts of at most `window` tokens, each opening as a user's prompt
    does (`bos_prefix`). Too short a text is an error: calibrating on less than asked would pass silently."""
    bos = bos_prefix(tokenizer)
    body = window - len(bos)
    if body < 1:
        raise ValueError(f"calibration prompts of {window} tokens leave no room for text")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"quantization_calibration_tokens={num_tokens}, but the calibration text has {len(ids)} tokens")
    ids = ids[:num_tokens]
    return [bos + ids[i:i + body] for i in range(0, len(ids), body)]


def hessian_passes(layers: list[tuple[str, Any, Any]], budget: int) -> list[list[tuple[str, Any, Any]]]:
    """`layers` in model order, cut into runs of whole decoder layers (so a pass can resume at its first one)
    whose fp32 [K, K] second moments fit `budget` (one decoder layer, or one layer outside them, at least)."""
    units: list[list[tuple[str, Any, Any]]] = []
    for entry in layers:
        index = _decoder_index(entry[0])
        if units and index is not None and _decoder_index(units[-1][-1][0]) == index:
            units[-1].append(entry)
        else:
            units.append([entry])
    passes: list[list[tuple[str, Any, Any]]] = []
    used = budget
    for unit in units:
        size = sum(4 * e[1].in_features ** 2 for e in unit)
        if used + size > budget:
            passes.append([])
            used = 0
        passes[-1].extend(unit)
        used += size
    return passes


def calibrate_quantized_weights(engine: Any, method: str, group: int, num_tokens: int,
                                text_file: str | None = None, checkpoint_path: str | None = None) -> CalibrationReport:
    """Quantize every quantizable layer of `engine.model` (dense, unpacked) to `method` ("int4" / "w4a8"), the
    int4 layers' codes by GPTQ on `num_tokens` calibration tokens. The pool must be idle.

    With `checkpoint_path`, fitted codes are kept in `$KVFORGE_CACHE_DIR/gptq/`, keyed by everything they depend
    on (`fitted_codes_key`): the next load of the same model with the same options reads them instead."""
    start = time.perf_counter()
    if text_file is None:
        text = default_calibration_text()
    else:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    window = min(CALIBRATION_WINDOW, engine.kv.capacity_tokens, engine.scheduler_config.max_model_len)
    layers = quantizable_layers(engine.model)
    fitted = [entry for entry in layers if layer_method(method, entry[0]) == method]
    cache_file = None
    if checkpoint_path is not None:
        dtype = str(next(p for p in engine.model.parameters() if p.is_floating_point()).dtype)
        key = fitted_codes_key(checkpoint_path, dtype, method, group, num_tokens, window, text)
        cache_file = cache_root() / "gptq" / f"{key}.pt"
        stored = read_fitted_codes(cache_file, {name: tuple(m.weight.shape) for name, m, _ in fitted})
        if stored is not None:
            for name, module, tied in fitted:
                attach_with_embedding(module, stored[name], tied)
            _quantize_the_rest(layers, method, group)
            return CalibrationReport(num_tokens, len(fitted), 0, time.perf_counter() - start, str(cache_file))
    prompts = calibration_windows(engine.tokenizer, num_tokens, window, text)
    passes = hessian_passes(fitted, HESSIAN_BUDGET_BYTES)
    blocks = _decoder_layers(engine.model, fitted)
    resume: _Resume | None = None  # where the prompts resume: the input of the pass's first decoder layer
    unseen: list[str] = []
    for number, run in enumerate(passes):
        moments: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        hooks = [module.register_forward_pre_hook(_accumulator(moments, seen, name, len(run)))
                 for name, module, _ in run]
        try:
            _run_prompts(engine, prompts, resume, seen.clear)
        finally:
            for hook in hooks:
                hook.remove()
        for name, module, tied in run:
            if name not in moments:  # e.g. an expert no calibration token was routed to: the search's codes
                unseen.append(name)
                continue
            parts = gptq_quantize(module.weight.detach(), moments.pop(name), method, group)
            qw = dataclasses.replace(pack_codes(*parts, act_int8=method == "w4a8"), fitted_by="GPTQ")
            attach_with_embedding(module, qw, tied)
        if blocks is not None and number + 1 < len(passes):
            # the next pass resumes at its first decoder layer, fed what this pass's quantized layers give it
            first = _decoder_index(passes[number + 1][0][0])
            assert first is not None  # `_decoder_layers`: every fitted layer sits in a decoder layer
            resume = _Resume(blocks, first, _next_inputs(engine, prompts, resume, blocks[first]))
    if len(unseen) == len(fitted):
        raise RuntimeError("the calibration prefill reached none of the layers to quantize (does this model call "
                           "its linear layers some other way?)")
    _quantize_the_rest(layers, method, group)
    if cache_file is not None:
        write_fitted_codes(cache_file, {name: module.quant_weight for name, module, _ in fitted})
    return CalibrationReport(num_tokens, len(fitted) - len(unseen), len(passes), time.perf_counter() - start,
                             unseen=len(unseen))


@dataclass
class _Resume:
    """Prompts run from decoder layer `start` on, its input per prompt in `inputs`: the layers before it are
    skipped (they return their input unchanged; nothing after them reads their KV)."""
    blocks: Any
    start: int
    inputs: list[torch.Tensor]


def _run_prompts(engine: Any, prompts: list[list[int]], resume: _Resume | None, before_each: Any = None) -> None:
    """Each prompt through `engine.prompt_logits`, resumed at `resume` when given, until a hook stops it
    (`_PassInputsTaken`) or it ends."""
    current = [0]
    undo: list[Any] = []
    if resume is not None:
        def feed(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = resume.inputs[current[0]]
            if x.shape != args[0].shape:
                raise RuntimeError(f"calibration prompt {current[0]}: kept input {tuple(x.shape)}, "
                                   f"the model passed {tuple(args[0].shape)}")
            return (x, *args[1:])
        for block in resume.blocks[:resume.start]:
            block.forward = _passthrough
        undo.append(resume.blocks[resume.start].register_forward_pre_hook(feed))
    try:
        for j, ids in enumerate(prompts):
            current[0] = j
            if before_each is not None:
                before_each()
            try:
                engine.prompt_logits(ids)
            except _PassInputsTaken:
                pass
    finally:
        for hook in undo:
            hook.remove()
        if resume is not None:
            for block in resume.blocks[:resume.start]:
                del block.forward  # the class's forward again
        if engine.kv.enable_caching:
            engine.reset_prefix_cache()  # those blocks hold skipped layers, or weights that are about to change


def _next_inputs(engine: Any, prompts: list[list[int]], resume: _Resume | None, block: Any) -> list[torch.Tensor]:
    """Each prompt's input to decoder layer `block`, with the layers before it as they are now (quantized)."""
    kept: list[torch.Tensor] = []

    def take(module: Any, args: tuple[Any, ...]) -> None:
        kept.append(args[0].detach().clone())
        raise _PassInputsTaken

    hook = block.register_forward_pre_hook(take)
    try:
        _run_prompts(engine, prompts, resume)
    finally:
        hook.remove()
    if len(kept) != len(prompts):
        raise RuntimeError("the calibration prefill did not reach every decoder layer")
    return kept


def _passthrough(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


_LAYER_PREFIX = "model.layers."


def _decoder_index(name: str) -> int | None:
    """`model.layers.7.mlp.down_proj` -> 7; None outside the decoder layers."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    head = name[len(_LAYER_PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _decoder_layers(model: Any, fitted: list[tuple[str, Any, Any]]) -> Any:
    """`model.model.layers` when every fitted layer sits in one of them (each is called `x = layer(x, ...)`, so
    a pass can resume at its first one), else None: then every pass runs the prompts from the start."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        return None
    if any(_decoder_index(name) is None or _decoder_index(name) >= len(blocks) for name, *_ in fitted):
        return None
    return blocks


def _quantize_the_rest(layers: list[tuple[str, Any, Any]], method: str, group: int) -> None:
    for name, module, tied in layers:
        if module.quant_weight is None:  # the lm_head (int8), as `weight_quant.quantize_model` does it
            attach_with_embedding(module, quantize(module.weight.detach(), layer_method(method, name), group), tied)


def fitted_codes_key(checkpoint_path: str, dtype: str, method: str, group: int, num_tokens: int, window: int,
                     text: str) -> str:
    """A digest of what fitted codes depend on: the checkpoint's files (names, sizes, modification times), the
    model dtype, format, group, token count, prompt length, the calibration text, and the source of the code
    that fits and lays them out (a change there is a new key, never a stale layout)."""
    digest = hashlib.sha256()
    root = Path(checkpoint_path)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
    for f in files:
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    digest.update(f"{dtype};{method};{group};{num_tokens};{window};".encode())
    digest.update(hashlib.sha256(text.encode()).digest())
    for module in (gptq, quant_linear, sys.modules[__name__]):
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()[:32]


def read_fitted_codes(path: Path, layers: dict[str, tuple[int, int]]) -> dict[str, QuantWeight] | None:
    """The codes `write_fitted_codes` kept at `path` for exactly `layers` (name -> (N, K)), or None: absent,
    unreadable, or for other layers or shapes. Then they are fitted again: the cache never decides what runs."""
    try:
        stored = torch.load(path, weights_only=True)
        out = {name: QuantWeight(**stored[name]) for name in layers}
    except Exception:  # noqa: BLE001 (a damaged file can fail in any of torch.load's layers; it is only a cache)
        return None
    if len(stored) != len(layers) or any((qw.n, qw.k) != layers[name] for name, qw in out.items()):
        return None
    return out


def write_fitted_codes(path: Path, layers: dict[str, QuantWeight]) -> None:
    """Keep the fitted layers' panels, scales and offsets (written to a temporary name, then renamed: a reader
    never sees half a file). A cache that cannot be written is skipped: the engine still serves."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save({name: {f.name: getattr(qw, f.name) for f in dataclasses.fields(qw)} for name, qw in layers.items()}, tmp)
        os.replace(tmp, path)
    except OSError as e:
        print(f"kvforge: GPTQ codes not cached ({e})", file=sys.stderr)


class _PassInputsTaken(Exception):
    """Raised by the last hook of a pass: the rest of the forward (later layers, the logits) is not needed."""


def _accumulator(moments: dict[str, torch.Tensor], seen: set[str], name: str, layers: int):  # type: ignore[no-untyped-def]
    def hook(module: Any, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float32)
        if name in moments:
            moments[name].addmm_(x.T, x)
        else:
            moments[name] = x.T @ x
        seen.add(name)
        if len(seen) == layers:  # every layer of the pass has this prompt's inputs: stop the forward here
            raise _PassInputsTaken
    return hook
