"""Command-line options generated from ServerArgs: the one place that turns its fields into flags.

Every ServerArgs field becomes an option: `--field-name` plus the extra spellings in its metadata
(`--model`, `-m`, `--algo`, ...), its help text, its help panel (`group`), its choices, and its type
(bool fields are on-switches such as `--disable-radix-cache`; Optional[int] / Optional[float] take a
number). Nothing here names a flag by hand, except `--config FILE`.

    @app.command()
    @server_args_options
    def serve(args: ServerArgs) -> None: ...

The decorated command receives a validated ServerArgs built by `build_server_args`: values from
`--config FILE` (YAML or JSON) first, then only the flags the user actually typed, so a flag left at
its default never overrides the file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping, Optional

import typer
from rich.markup import escape

from engine.config import SPECULATIVE_ALGORITHM_ALIASES, TOOL_CALL_PARSER_ALIASES, ServerArgs

CONFIG_HELP = ("YAML or JSON file of options (keys as flags or snake_case, e.g. the file `spec tune --save` "
               "writes). Flags given on the command line override its values.")
# Choices matched without regard to case; their extra accepted spellings (SGLang's NEXTN = MTP).
CASE_INSENSITIVE = frozenset({"speculative_algorithm"})
# The width --help is kept to: a flag's line that would pass it names its choices in the help instead.
HELP_WIDTH = 80
EXTRA_CHOICES: dict[str, tuple[str, ...]] = {"speculative_algorithm": tuple(SPECULATIVE_ALGORITHM_ALIASES),
                                              "tool_call_parser": TOOL_CALL_PARSER_ALIASES}

FIELDS: tuple[dataclasses.Field, ...] = tuple(dataclasses.fields(ServerArgs))
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
# Spellings accepted on the command line but not listed in --help (spec_cli/prefixes.py reads them).
HIDDEN_FLAGS: dict[str, str] = {hidden: "--" + f.name.replace("_", "-")
                                for f in FIELDS for hidden in f.metadata.get("hidden", ())}
_HINTS = typing.get_type_hints(ServerArgs)
_CONFIG = "config"
_CONTEXT = "spec_cli_context__"  # injected by Typer; never a flag


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """Optional[X] -> (X, True); X -> (X, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def _option_parameter(f: dataclasses.Field) -> inspect.Parameter:
    meta = f.metadata
    base, optional = _split_optional(_HINTS[f.name])
    shown = tuple(meta.get("choices") or ())
    choices = shown + EXTRA_CHOICES.get(f.name, ())  # the extra spellings are accepted, not listed
    if choices:
        base = Literal[choices]  # Typer checks them and completes them
    annotation = Optional[base] if optional else base
    main = flag_name(f.name)
    decls = [main, *(s for s in meta.get("flags", ()) if s != main)]  # a bool with one name: an on-switch
    # Typer would list case-insensitive choices in lower case, and the extra spellings too.
    metavar = (("[" + "|".join(shown) + "]") if shown and f.name in CASE_INSENSITIVE
               else ("<" + "|".join(shown) + ">") if f.name in EXTRA_CHOICES else None)
    help = meta["help"]
    if metavar and len(f"  {', '.join(decls)} {metavar}") > HELP_WIDTH:    # the choices move into the help
        metavar, help = "NAME", f"{help} One of: {', '.join(shown)}."
    info = typer.Option(
        *decls,
        help=escape(help),
        rich_help_panel=meta.get("group") or None,
        case_sensitive=f.name not in CASE_INSENSITIVE,
        metavar=metavar,
        show_default=base is not bool,
    )
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, info])


def option_parameters() -> list[inspect.Parameter]:
    """`--config` and one keyword-only parameter per ServerArgs field, in field order."""
    config = inspect.Parameter(
        _CONFIG, inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[Optional[str], typer.Option("--config", metavar="FILE", help=CONFIG_HELP,
                                                         show_default=False)])
    return [config, *(_option_parameter(f) for f in FIELDS)]


def build_server_args(values: Mapping[str, Any], *, explicit: Iterable[str] | None = None,
                      config: str | os.PathLike | None = None) -> ServerArgs:
    """The ServerArgs for parsed option `values` (field name -> value).

    Only the names in `explicit` (the flags the user typed; None: all of `values`) are used, on top of
    the `config` file's values when one is given; every other field keeps the ServerArgs default.
    Raises ConfigError (a SpecError) for an invalid value or combination, before anything loads.
    """
    names = set(values) if explicit is None else set(explicit)
    given = {name: value for name, value in values.items() if name in names}
    if config is not None:
        return ServerArgs.from_file(config, **given)
    return ServerArgs.from_dict(given)


def _typed_on_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def server_args_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a Typer command every ServerArgs flag plus `--config`; call it with the built ServerArgs.

    `func` takes one parameter annotated `ServerArgs` (any name) and may take other Typer parameters.
    """
    signature = inspect.signature(func, eval_str=True)
    target = next((p.name for p in signature.parameters.values() if p.annotation is ServerArgs), None)
    if target is None:
        raise TypeError(f"{func.__name__} needs a parameter annotated ServerArgs")
    own = [p for p in signature.parameters.values() if p.name != target]
    # Typer hands a click context to a parameter annotated typer.Context; reuse the command's own if any.
    own_context = next((p.name for p in own if isinstance(p.annotation, type)
                        and issubclass(p.annotation, typer.Context)), None)
    extra = [] if own_context else [inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY,
                                                      annotation=typer.Context)]
    positional = [p for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p for p in own if p not in positional]
    new_signature = signature.replace(parameters=[*positional, *keyword, *extra, *option_parameters()])

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = kwargs[own_context] if own_context else kwargs.pop(_CONTEXT)
        config = kwargs.pop(_CONFIG)
        values = {name: kwargs.pop(name) for name in FIELD_NAMES}
        explicit = [name for name in FIELD_NAMES if _typed_on_command_line(ctx, name)]
        kwargs[target] = build_server_args(values, explicit=explicit, config=config)
        return func(*args, **kwargs)

    wrapper.__signature__ = new_signature  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in new_signature.parameters.values()
                               if p.annotation is not inspect.Parameter.empty}
    return wrapper
