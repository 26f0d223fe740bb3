"""Reading GGUF metadata values: torch-free, so tokenizer-only paths (`kvforge cache explain`) skip torch."""
from __future__ import annotations

from typing import Any


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or `default` when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
