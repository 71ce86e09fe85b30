"""spec's serving engine: paged KV cache with radix prefix sharing, continuous batching, speculative decoding."""

from engine.config import ServerArgs
from engine.engine import Engine
from engine.errors import ConfigError, ModelLoadError, RequestError, SpecError

__all__ = ["Engine", "ServerArgs", "SpecError", "ConfigError", "ModelLoadError", "RequestError"]
