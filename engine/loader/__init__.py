"""Model loading: resolve a model argument to a local HF directory, then read its config, weights and tokenizer."""

from engine.loader.fetch import KNOWN_MODELS, fetch_model, models_dir
from engine.loader.gguf_convert import convert_gguf
from engine.loader.source import resolve_model_path
from engine.loader.weights import iter_weights, load_config, load_tokenizer, quantized_groups, transformers_model

__all__ = [
    "KNOWN_MODELS",
    "convert_gguf",
    "fetch_model",
    "iter_weights",
    "load_config",
    "load_tokenizer",
    "models_dir",
    "quantized_groups",
    "resolve_model_path",
    "transformers_model",
]
