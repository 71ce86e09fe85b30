"""Supported architectures, by the `architectures` name in a checkpoint's config.json."""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(config, source: str):
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{source}: architecture {', '.join(archs) or config.model_type!r} is not supported. "
        f"Supported: {', '.join(ARCHITECTURES)}. Pass a model of one of these families "
        "(Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5, Qwen3).")
