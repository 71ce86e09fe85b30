"""The `spec` command line: serve, bench, tune, convert and fetch, built on engine.ServerArgs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("spec")
except PackageNotFoundError:  # running from a source tree that was never pip-installed
    __version__ = "0+unknown"
