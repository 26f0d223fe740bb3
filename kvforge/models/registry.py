"""Maps an HF `architectures` name to the kvforge model class that runs it."""
from __future__ import annotations

from torch import nn

from kvforge.config import ModelConfig
from kvforge.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvforge.models.gemma import GemmaForCausalLM
from kvforge.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    try:
        cls = MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        ) from None
    return cls(cfg)
