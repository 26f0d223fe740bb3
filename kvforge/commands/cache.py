"""`kvforge cache explain PROMPT_A PROMPT_B`: why B misses the prefix cache A filled.

Loads only the model's tokenizer (no weights), tokenizes both prompts as the
engine would, and prints how many blocks hit, the first diverging token and
block, the text around it, and a warning when the difference looks dynamic.
"""
from __future__ import annotations

import argparse
import json
import os

from kvforge.config import CacheConfig
from kvforge.flags import default_of, flag_errors


HELP = "show where prompt B stops reusing prompt A's cached blocks"


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("prompt_a", nargs="?", default=None, help="first prompt (the one already cached)")
    e.add_argument("prompt_b", nargs="?", default=None, help="second prompt")
    e.add_argument("--file-a", default=None, help="read prompt A from a file (for long prompts)")
    e.add_argument("--file-b", default=None, help="read prompt B from a file")
    e.add_argument("--model", default=None, help="HF folder or .gguf whose tokenizer to use (default SmolLM2-135M)")
    e.add_argument("--block-size", type=int, default=default_of(CacheConfig, "block_size"), help="tokens per KV block")
    e.add_argument("--salt-a", default=None, help="cache_salt of request A")
    e.add_argument("--salt-b", default=None, help="cache_salt of request B")
    e.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from kvforge.kv.explain import explain

    with flag_errors({"block_size": "--block-size"}):
        block_size = CacheConfig(block_size=args.block_size).block_size  # validates
    prompt_a = _prompt(args.prompt_a, args.file_a, "a")
    prompt_b = _prompt(args.prompt_b, args.file_b, "b")
    tok = load_tokenizer(args.model)
    report = explain(tok.encode(prompt_a), tok.encode(prompt_b), block_size, tok.decode,
                     prompt_a, prompt_b, args.salt_a, args.salt_b)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0


def _prompt(text: str | None, path: str | None, which: str) -> str:
    if text is not None and path is not None:
        raise ValueError(f"give prompt {which.upper()} either as an argument or with --file-{which}, not both")
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--file-{which} {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if not text:
        raise ValueError(f"prompt {which.upper()} is missing or empty (positional argument or --file-{which})")
    return text


def load_tokenizer(model: str | None):  # type: ignore[no-untyped-def]
    """The tokenizer of `model` without loading its weights (HF folder, .gguf, or the default model)."""
    from kvforge.models.loader import DEFAULT_MODEL_NAME, default_model_path
    from kvforge.tokenizer import Tokenizer

    path = default_model_path() if model in (None, DEFAULT_MODEL_NAME) else os.fspath(model)
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    if os.path.isfile(path):
        raise ValueError(f"--model {path!r} is a file but not a .gguf; pass a .gguf file or an HF model folder")
    raise FileNotFoundError(f"--model {path!r} does not exist (expected an HF model folder or a .gguf file)")


def _gguf_tokenizer(path: str):  # type: ignore[no-untyped-def]
    """A GGUF file's tokenizer, cached as JSON in kvforge's cache dir after the first use.

    Why: building a tokenizer from GGUF metadata takes seconds for a large vocabulary (2.8 s for
    Gemma 3's 262,144 tokens), far more than tokenizing two prompts. The cache key is the file's
    path, size and mtime, so a changed file is read again.
    """
    import hashlib
    import tempfile

    from tokenizers import Tokenizer as HFTokenizer

    from kvforge.native import cache_root
    from kvforge.tokenizer import Tokenizer

    st = os.stat(path)
    key = hashlib.sha256(f"v1|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "tokenizers" / f"{os.path.basename(path)}-{key}.json"
    if cached.is_file():
        try:
            data = json.loads(cached.read_text(encoding="utf-8"))
            return Tokenizer(HFTokenizer.from_str(data["backend"]), **data["meta"])
        except Exception:  # a damaged or foreign cache entry: rebuild it
            pass
    from kvforge.gguf_file import GGUFFile
    from kvforge.gguf_tokenizer import build_gguf_tokenizer

    try:
        reader = GGUFFile(path)
    except Exception as e:  # GGUFFile raises ValueError on foreign or truncated files
        raise ValueError(f"--model {path!r} is not a readable GGUF file: {e}") from e
    backend, meta = build_gguf_tokenizer(reader)
    meta = {"bos_token_id": None if meta["bos_token_id"] is None else int(meta["bos_token_id"]),
            "eos_token_ids": [int(e) for e in meta["eos_token_ids"]], "add_bos_token": bool(meta["add_bos_token"]),
            "chat_template": meta["chat_template"]}
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=cached.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"backend": backend.to_str(), "meta": meta}, f)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache dir only costs speed
    return Tokenizer(backend, **meta)
