"""Presenting what `spec bench` and `spec tune` measured: a progress bar while they run, rich tables at
the end, a JSON file with every figure, and a PNG plot (matplotlib, optional)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from spec_tools.bench import BenchError


class BarProgress:
    """The Progress of spec_tools.bench.run as a rich bar on stderr: one task whose total is set per phase."""

    def __init__(self, console: Console):
        # Off a terminal (CI logs, pipes) a live bar would only leave blank lines.
        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
        self._task = None

    def __enter__(self) -> "BarProgress":
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def phase(self, description: str, total: Optional[int] = None) -> None:
        if self._task is None:
            self._task = self._bar.add_task(description, total=total)
        else:
            self._bar.reset(self._task, total=total, description=description)

    def advance(self, description: str, steps: int = 1) -> None:
        self._bar.update(self._task, advance=steps, description=description)


# ------------------------------------------------------------------ formatting
def fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def ms(dist: Optional[dict], key: str) -> str:
    return "-" if dist is None else f"{1000 * dist[key]:.1f}"


# ------------------------------------------------------------------ spec bench
def bench_table(result: dict) -> Table:
    runs = [(result["label"], result)] + ([("baseline", result["baseline"])] if result["baseline"] else [])
    table = Table(title=f"spec bench ({result['mode']})", title_justify="left")
    table.add_column("metric")
    for name, _ in runs:
        table.add_column(name, justify="right")
    if len(runs) == 2:
        table.add_column("ratio", justify="right")

    def row(label: str, key, digits: int = 2, ratio: bool = False) -> None:
        values = [key(r) if callable(key) else r[key] for _, r in runs]
        cells = [v if isinstance(v, str) else fmt(v, digits) for v in values]
        if len(runs) == 2:
            a, b = values
            cells.append(fmt(a / b, 2) + "x" if ratio and isinstance(a, (int, float)) and b else "")
        table.add_row(label, *cells)

    row("requests", "num_requests")
    row("output tokens", "completion_tokens")
    row("duration (s)", "duration_s")
    row("output tokens/s", "output_tokens_per_s", ratio=True)
    row("decode tokens/s (after the first)", "decode_tokens_per_s", 1, ratio=True)
    row("requests/s", "requests_per_s", ratio=True)
    row("accept length", "accept_length")
    row("accept rate by position", lambda r: " ".join(f"{p:.2f}" for p in r["accept_rate_by_position"] or []) or "-")
    row("decode step (ms)", "step_time_ms", 1)
    if any(r.get("prediction_tokens") for _, r in runs):
        row("prediction tokens accepted / rejected", lambda r: "{accepted} / {rejected}".format(
            **r["prediction_tokens"]) if r.get("prediction_tokens") else "-")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_latency_s", "end-to-end")):
        for p in ("mean", "p50", "p90", "p99"):
            row(f"{label} {p} (ms)", lambda r, key=key, p=p: ms(r[key], p))
    return table


def category_table(result: dict) -> Table:
    base = result["baseline"]
    table = Table(title="by category", title_justify="left", caption_justify="left",
                  caption="tok/s: each request's tokens / its latency, averaged")
    for col in ("category", "requests", "tokens", f"{result['label']} tok/s"):
        table.add_column(col, justify="left" if col == "category" else "right")
    if base:
        table.add_column("baseline tok/s", justify="right")
    accept = any(cat["accept_length"] is not None for cat in result["categories"].values())
    if accept:
        table.add_column("accept length", justify="right")
    for name, cat in result["categories"].items():
        cells = [name, str(cat["num_requests"]), str(cat["completion_tokens"]), fmt(cat["output_tokens_per_s"], 1)]
        if base:
            cells.append(fmt(base["categories"].get(name, {}).get("output_tokens_per_s"), 1))
        table.add_row(*cells, *([fmt(cat["accept_length"])] if accept else []))
    return table


def print_bench(console: Console, result: dict) -> None:
    console.print(bench_table(result))
    if len(result["categories"]) > 1 or result["baseline"]:
        console.print(category_table(result))
    if result.get("speedup") is not None:
        over = "the same requests without predictions" if result["label"] == "prediction" else "plain decoding"
        line = f"speedup over {over}: [bold]{result['speedup']:.2f}x[/bold] (output tokens/s, interleaved runs)"
        if result.get("differing_outputs") is not None:
            line += (f"; greedy outputs differing from the baseline: {result['differing_outputs']} of "
                     f"{result['num_requests']}")
        console.print(line, soft_wrap=True)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def require_matplotlib():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or install spec with its 'plot' extra).") from None
    return matplotlib


def plot_bench(path: str | Path, result: dict) -> None:
    """Two panels: how many verifications accepted each length, and tokens/s per request by category."""
    require_matplotlib().use("Agg")       # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    hist = result["accept_length_histogram"] or {}
    if hist:
        lengths = [int(k) for k in hist]
        left.bar(lengths, list(hist.values()), color="tab:blue")
        left.set_xticks(lengths)
        left.set_title(f"accept length per verification (mean {result['accept_length']:.2f})")
        left.set_xlabel("tokens accepted (drafts + bonus)")
        left.set_ylabel("verifications")
    else:
        left.text(0.5, 0.5, "no speculative decoding measured", ha="center", va="center")
        left.set_axis_off()
    cats = list(result["categories"])
    runs = [(result["label"], result)] + ([("baseline", result["baseline"])] if result["baseline"] else [])
    width = 0.8 / len(runs)
    for i, (name, run) in enumerate(runs):
        values = [run["categories"].get(c, {}).get("output_tokens_per_s") or 0.0 for c in cats]
        right.bar([x + i * width for x in range(len(cats))], values, width, label=name)
    right.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
    right.set_ylabel("output tokens/s per request")
    right.set_title("speed by category")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ spec tune
def tune_table(bs: int, entry: dict) -> Table:
    table = Table(title=f"batch size {bs}", title_justify="left", caption_justify="left",
                  caption="tree: steps x topk x draft tokens; speedup: over the baseline on the same prompts")
    for col in ("tree", "prompts", "accept", "step ms", "tok/s", "speedup", "status"):
        table.add_column(col, justify="left" if col in ("tree", "status") else "right")
    for r in entry["results"]:
        style = "bold green" if r["status"] == "best" else ("dim" if r["status"].startswith("cut") else None)
        table.add_row(r["label"], str(r["prompts"]), fmt(r["accept_length"]), fmt(r["step_time_ms"], 1),
                      fmt(r["output_tokens_per_s"], 1), fmt(r["speedup"]) + "x" if r["speedup"] is not None else "-",
                      r["status"], style=style)
    return table


def print_tune(console: Console, result: dict) -> None:
    for bs, entry in result["batch_sizes"].items():
        console.print(tune_table(int(bs), entry))
    if result["skipped"]:
        shown = ", ".join("x".join(map(str, s["tree"])) for s in result["skipped"][:8])
        more = f" and {len(result['skipped']) - 8} more" if len(result["skipped"]) > 8 else ""
        console.print(f"[dim]skipped {len(result['skipped'])} impossible combinations (steps x topk x draft "
                      f"tokens): {shown}{more}[/dim]")
    console.print(f"{result['evaluations']} evaluations in {result['duration_s']:.0f} s "
                  f"({result['prompt_runs']} prompt runs; a full grid would take {result['full_grid_prompt_runs']})"
                  + ("; stopped at --time-budget" if result["out_of_time"] else ""))
    for bs, entry in result["batch_sizes"].items():
        best = entry["best"]
        verdict = "" if best["tree"] else "; no tree beat plain decoding, so this config turns speculation off"
        console.print(f"\n[bold]best at batch size {bs}[/bold]: {best['label']} "
                      f"({fmt(best['output_tokens_per_s'], 1)} tokens/s, {fmt(best['speedup'])}x{verdict})")
        console.print(entry["command"], markup=False, highlight=False, soft_wrap=True)
