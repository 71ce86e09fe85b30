"""The HTTP server behind `spec serve`: OpenAI-compatible and SGLang-compatible routes over the Engine."""

__all__ = ["create_app", "make_server", "run_server"]


def __getattr__(name: str):
    # The app pulls in the engine and torch; the body parser's children (bodies.py) import the request
    # models alone.
    if name == "create_app":
        from engine.server.app import create_app

        return create_app
    if name in ("make_server", "run_server"):
        from engine.server import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'engine.server' has no attribute {name!r}")
