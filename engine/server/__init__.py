"""The HTTP server behind `spec serve`: OpenAI-compatible and SGLang-compatible routes over the Engine."""

from engine.server.app import create_app
from engine.server.launch import make_server, run_server

__all__ = ["create_app", "make_server", "run_server"]
