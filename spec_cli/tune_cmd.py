"""`spec tune`: search tree shapes per batch size on one loaded engine; save the best as a serve config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from spec_tools.bench import BenchError
from spec_tools.bench.options import TuneOptions
from engine.config import ServerArgs
from spec_cli.args import server_args_options
from spec_cli.bench_cmd import Dataset, DatasetPath, MaxNewTokens, NumPrompts, Temperature
from spec_cli.errors import reports_user_errors

PANEL = "Search"


def int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise BenchError(f"{option} takes comma-separated integers such as 1,2,4; got {text!r}.") from None
    if not values:
        raise BenchError(f"{option} needs at least one value.")
    return values


def _csv(values) -> str:
    return ",".join(map(str, values))


def _grid(flag: str, help: str):
    return Annotated[str, typer.Option(flag, metavar="N,N,...", rich_help_panel=PANEL, help=help)]


SearchSteps = _grid("--search-steps", "Draft depths to try (--speculative-num-steps).")
SearchTopk = _grid("--search-topk", "Branching factors to try (--speculative-eagle-topk); 1 is a chain of steps + 1 "
                                    "tokens.")
SearchDraftTokens = _grid("--search-draft-tokens", "Tree sizes to try for topk > 1 (--speculative-num-draft-tokens); "
                                                   "impossible ones (> topk + (steps-1)*topk^2 + 1) are skipped.")
BatchSizes = _grid("--batch-sizes", "Batch sizes to tune for, each searched separately; the best config sets "
                                    "--max-running-requests and --cuda-graph-max-bs to it.")


@reports_user_errors
@server_args_options
def tune(
    args: ServerArgs,
    search_steps: SearchSteps = _csv(TuneOptions.steps),
    search_topk: SearchTopk = _csv(TuneOptions.topk),
    search_draft_tokens: SearchDraftTokens = _csv(TuneOptions.draft_tokens),
    batch_sizes: BatchSizes = _csv(TuneOptions.batch_sizes),
    time_budget: Annotated[float, typer.Option(
        "--time-budget", metavar="SECONDS", rich_help_panel=PANEL,
        help="Stop searching after this long (checked between evaluations; model loading not counted) and report "
             "the best so far.")] = TuneOptions.time_budget,
    dataset: Dataset = None,
    dataset_path: DatasetPath = None,
    num_prompts: NumPrompts = TuneOptions.num_prompts,
    max_new_tokens: MaxNewTokens = TuneOptions.max_new_tokens,
    temperature: Temperature = TuneOptions.temperature,
    save: Annotated[Optional[Path], typer.Option(
        "--save", metavar="FILE", rich_help_panel=PANEL, show_default=False,
        help="Write the best config for the largest batch size as YAML (or JSON for .json) for "
             "spec serve --config FILE.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", metavar="FILE.json", rich_help_panel=PANEL, show_default=False,
        help="Write every measurement as JSON.")] = None,
) -> None:
    """Search speculative tree settings (--steps, --topk, --draft-tokens) for the best speed per batch size.

    Loads the target once and swaps the speculative worker per candidate; successive halving gives the faster half of the candidates more prompts each round, against a no-speculation baseline that runs every round. Prints a table per batch size and the best config as a [bold]spec serve[/bold] command line; --save FILE writes it for [bold]spec serve --config FILE[/bold].

    [bold]Examples[/bold]
      spec tune --model smollm2-135m --algo NGRAM --batch-sizes 1,4 --save tuned.yaml
      spec tune --model M --draft D --algo EAGLE3 --search-steps 3,5,7 --search-topk 1,4,8 --time-budget 1800
    """
    from spec_tools.bench.report import BarProgress, print_tune, write_json
    from spec_tools.bench.tune import run_tune, save_config

    opts = TuneOptions(int_list(search_steps, "--search-steps"), int_list(search_topk, "--search-topk"),
                       int_list(search_draft_tokens, "--search-draft-tokens"), int_list(batch_sizes, "--batch-sizes"),
                       time_budget, dataset, str(dataset_path) if dataset_path else None, num_prompts,
                       max_new_tokens, temperature)
    with BarProgress(Console(stderr=True)) as progress:
        result = run_tune(args, opts, progress)
    console = Console()
    print_tune(console, result)
    if save is not None:
        largest = max(result["batch_sizes"], key=int)
        save_config(save, result["batch_sizes"][largest]["config"])
        result["saved"] = {"path": str(save), "batch_size": int(largest)}
        console.print(f"\nsaved the batch size {largest} config to {save}: spec serve --config {save}",
                      markup=False, highlight=False, soft_wrap=True)
    if output is not None:
        write_json(output, result)
