"""Supported architectures, by the `architectures` name in a checkpoint's config.json."""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.loader.fp8_quant import fp8_checkpoint
from engine.models.deepseek import DeepseekV3ForCausalLM
from engine.models.gemma import GemmaForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtures import MixtureForCausalLM

ARCHITECTURES = {
    "DeepseekV2ForCausalLM": DeepseekV3ForCausalLM,     # V3's decoder with a softmax router
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,     # MLA, MoE and a nextn layer, which the target skips
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,         # Gemma 3's text decoder (gemma3_text)
    "GptOssForCausalLM": GptOssForCausalLM,       # MXFP4 experts: engine/loader/mxfp4.py
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtureForCausalLM,
    "MiMoForCausalLM": LlamaForCausalLM,          # Qwen2 plus MTP layers, which the target skips
    "Phi3ForCausalLM": LlamaForCausalLM,          # Phi-3/3.5/4: q/k/v and gate/up stored fused, as Llama's run
    "OlmoeForCausalLM": MixtureForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": MixtureForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MixtureForCausalLM,
}


# Configs converted from GGUF may name no architecture; their model_type says as much.
MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
               "qwen3": LlamaForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM, "granite": GraniteForCausalLM,
               "gemma2": GemmaForCausalLM, "gemma3_text": GemmaForCausalLM, "gpt_oss": GptOssForCausalLM,
               "phi3": LlamaForCausalLM, "mixtral": MixtureForCausalLM, "olmoe": MixtureForCausalLM,
               "qwen2_moe": MixtureForCausalLM, "qwen3_moe": MixtureForCausalLM}


def model_class(config, source: str):
    fp8_checkpoint(getattr(config, "quantization_config", None), source)     # FP8 is read, the rest refused
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and config.model_type in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    raise ModelLoadError(
        f"{source}: architecture {', '.join(archs) or config.model_type!r} is not supported. "
        f"Supported: {', '.join(ARCHITECTURES)}. Pass a model of one of these families "
        "(Llama 2/3/3.1, SmolLM2, Mistral, Mixtral, Qwen2/2.5, Qwen2-MoE, Qwen3, Qwen3-MoE, MiMo, OLMoE, "
        "DeepSeek-V2, DeepSeek-V3, Granite 3, Phi-3/3.5/4, Gemma 2, Gemma 3 text, GPT-OSS).")
