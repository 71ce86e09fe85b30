"""`spec bench`: throughput, acceptance and latency of speculative decoding, in-process or against a server.

Its own options sit in the "Benchmark" help panel, next to every `spec serve` flag (which configure the
in-process engine). The dataset options are shared with `spec tune`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console

from spec_tools.bench.datasets import DATASET_NAMES
from spec_tools.bench.options import BenchOptions
from engine.config import ServerArgs
from spec_cli.args import server_args_options
from spec_cli.errors import reports_user_errors

PANEL = "Benchmark"
DATASET_PANEL = "Prompts"

Dataset = Annotated[Optional[Literal[DATASET_NAMES]], typer.Option(
    "--dataset", rich_help_panel=DATASET_PANEL, show_default=False,
    help="Prompt set: mt-bench (default; both turns, the second after the model's own answer), gsm8k, humaneval, "
         "sharegpt, random (synthetic, see --random-*), or code-edit (edits of Python standard-library functions, "
         "each with the function as its prediction, see --use-prediction). Named sets are read from $SPEC_DATASETS_DIR or "
         "shared/datasets/; a missing one is an error that says which file to fetch.")]
DatasetPath = Annotated[Optional[Path], typer.Option(
    "--dataset-path", metavar="FILE", rich_help_panel=DATASET_PANEL, show_default=False,
    help="Read prompts from FILE instead: a question.jsonl (one {\"turns\": [...], \"category\": ...} a line; "
         "\"prompt\" or \"question\" also work; a \"prediction\" string is the first turn's Predicted Output) "
         "or a ShareGPT .json.")]
NumPrompts = Annotated[Optional[int], typer.Option(
    "--num-prompts", "-n", min=1, rich_help_panel=DATASET_PANEL,
    help="Use this many prompts, taken across categories in turn (default: all; random: 32).")]
MaxNewTokens = Annotated[int, typer.Option(
    "--max-new-tokens", min=1, rich_help_panel=DATASET_PANEL, help="Most tokens generated per turn.")]
Temperature = Annotated[float, typer.Option(
    "--temperature", min=0.0, rich_help_panel=DATASET_PANEL,
    help="Sampling temperature; 0 is greedy (outputs are then compared with the baseline's).")]


@reports_user_errors
@server_args_options
def bench(
    args: ServerArgs,
    dataset: Dataset = None,
    dataset_path: DatasetPath = None,
    num_prompts: NumPrompts = None,
    max_new_tokens: MaxNewTokens = BenchOptions.max_new_tokens,
    temperature: Temperature = BenchOptions.temperature,
    random_input_len: Annotated[int, typer.Option(
        "--random-input-len", min=1, rich_help_panel=DATASET_PANEL,
        help="random: words per prompt.")] = BenchOptions.random_input_len,
    random_output_len: Annotated[int, typer.Option(
        "--random-output-len", min=1, rich_help_panel=DATASET_PANEL,
        help="random: tokens generated per prompt (EOS ignored).")] = BenchOptions.random_output_len,
    max_concurrency: Annotated[int, typer.Option(
        "--max-concurrency", "--batch-size", min=1, rich_help_panel=PANEL,
        help="Conversations in flight at once (the decode batch size).")] = BenchOptions.max_concurrency,
    compare_baseline: Annotated[bool, typer.Option(
        "--compare-baseline", rich_help_panel=PANEL,
        help="Also run every request without speculation, interleaved in the same process, and report the "
             "speedup (and, when greedy, how many outputs differ).")] = False,
    use_prediction: Annotated[bool, typer.Option(
        "--use-prediction", rich_help_panel=PANEL,
        help="Send each prompt's prediction (OpenAI's Predicted Outputs; --dataset code-edit) and run the same "
             "requests without it, interleaved: the speedup predictions give, with accepted and rejected "
             "prediction tokens.")] = False,
    url: Annotated[Optional[str], typer.Option(
        "--url", rich_help_panel=PANEL, show_default=False,
        help="Benchmark a running OpenAI-compatible server (spec serve, SGLang, vLLM) through streaming "
             "/v1/chat/completions instead of loading the model here; --api-key is sent as its bearer token.")] = None,
    baseline_url: Annotated[Optional[str], typer.Option(
        "--baseline-url", rich_help_panel=PANEL, show_default=False,
        help="With --url: a second server without speculation, run interleaved as the baseline.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", metavar="FILE.json", rich_help_panel=PANEL, show_default=False,
        help="Write every figure and the resolved configuration as JSON.")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", metavar="FILE.png", rich_help_panel=PANEL, show_default=False,
        help="Plot the accept-length histogram and tokens/s per category (needs matplotlib).")] = None,
) -> None:
    """Benchmark speculative decoding: output tokens/s, accept length, TTFT/ITL/latency, per category.

    Runs offline in-process (the same flags as [bold]spec serve[/bold]) or against a running server (--url). With --compare-baseline, the same requests also run without speculation, interleaved, and the speedup is reported as a ratio: the one number that holds on a busy machine.

    [bold]Examples[/bold]
      spec bench --model smollm2-135m --algo NGRAM --compare-baseline -n 8
      spec bench --model M --draft D --algo EAGLE3 --dataset gsm8k --output run.json --plot run.png
      spec bench --url http://127.0.0.1:30000 --max-concurrency 4
    """
    from spec_tools.bench.report import BarProgress, plot_bench, print_bench, require_matplotlib, write_json
    from spec_tools.bench.run import run_bench

    if plot is not None:
        require_matplotlib()     # before the run, not after it
    opts = BenchOptions(dataset, str(dataset_path) if dataset_path else None, num_prompts, max_new_tokens, temperature,
                        max_concurrency, random_input_len, random_output_len, url, baseline_url, compare_baseline,
                        use_prediction)
    with BarProgress(Console(stderr=True)) as progress:
        result = run_bench(args, opts, progress)
    print_bench(Console(), result)
    if output is not None:
        write_json(output, result)
    if plot is not None:
        plot_bench(plot, result)
