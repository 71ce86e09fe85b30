"""Unambiguous prefixes of long options, accepted the way argparse (and so SGLang's launcher) accepts
them: `--speculative-algo` is `--speculative-algorithm`. A prefix that names one option stands for it,
an exact name always wins (the spellings --help does not list, spec_cli.args.HIDDEN_FLAGS, too), and a
prefix shared by several options is an error that lists them.

Click has no such matching, so `PrefixGroup` (the class of every `spec` command group) expands each
command's long options before click parses them: its own, in `parse_args`, and a subcommand's, in
`resolve_command`, where that subcommand is found. It also reports click's own usage errors (an unknown
flag, a bad value, a missing argument) as spec reports every user error, one `error:` line with status
2, and lays its help out as the commands' (spec_cli/help.py).
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import typer
from typer import Context
from typer.core import TyperGroup

from spec_cli.args import HIDDEN_FLAGS
from spec_cli.errors import fail, print_error
from spec_cli.help import write_help


def _options(command: Any, ctx: Context) -> dict[str, Any]:
    """Every option spelling of a click `command` (short ones too) -> its option."""
    return {name: param for param in command.get_params(ctx) if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)}


def expand_prefixes(command: Any, ctx: Context, args: Iterable[str]) -> list[str]:
    """`args` with each long option given by a unique prefix of its name spelled out in full."""
    options = _options(command, ctx)
    longs = [name for name in options if name.startswith("--")]
    out: list[str] = []
    rest = list(args)
    while rest:
        token = rest.pop(0)
        if token == "--" or (not token.startswith("-") and isinstance(command, TyperGroup)):
            return out + [token] + rest     # the end of options, or a group's subcommand and its arguments
        name, eq, value = token.partition("=")
        if HIDDEN_FLAGS.get(name) in options:
            name = HIDDEN_FLAGS[name]
        elif name.startswith("--") and name not in options:
            matches = [o for o in longs if o.startswith(name)]
            params = {id(options[o]) for o in matches}
            if len(params) > 1 and not ctx.resilient_parsing:     # shell completion guesses quietly
                fail(f"Option {name} is ambiguous: it could be {', '.join(matches)}. Type more of its name.")
            if len(params) == 1:
                name = matches[0]
        out.append(name + eq + value)
        option = options.get(name)
        if option is not None and not eq and not option.is_flag and not option.count and rest:
            out.append(rest.pop(0))         # its value, whatever it looks like
    return out


class PrefixGroup(TyperGroup):
    def format_help(self, ctx: Context, formatter: Any) -> None:
        write_help(self, ctx, formatter)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            status = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as exc:       # click's (Typer's copy): Typer would draw it in a box
            if type(exc).__name__ == "NoArgsIsHelpError":      # a group run bare: its help is the answer
                typer.echo(exc.format_message())
                sys.exit(exc.exit_code)
            command = exc.ctx.command_path if getattr(exc, "ctx", None) else self.name
            print_error(f"{exc.format_message().rstrip('.')}; see '{command} --help'.")
            sys.exit(exc.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(1)
        sys.exit(status if isinstance(status, int) else 0)

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_prefixes(self, ctx, args))

    def resolve_command(self, ctx: Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            rest = expand_prefixes(command, ctx, rest)
        return name, command, rest
