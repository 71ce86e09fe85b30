"""spec's serving engine: paged KV cache with radix prefix sharing, continuous batching, speculative decoding."""

from engine.config import ServerArgs
from engine.errors import ConfigError, ModelLoadError, RequestError, SpecError

__all__ = ["Engine", "ServerArgs", "SpecError", "ConfigError", "ModelLoadError", "RequestError"]


def __getattr__(name: str):
    # Engine pulls in torch; the CLI imports engine.config for --help and completions and must stay fast.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
