"""`spec convert`: FR-Spec token maps, EAGLE / EAGLE-3 draft conversion, and EAGLE-3 head training.

The work lives in spec_tools/convert/; these commands parse options, show progress and print reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from spec_cli.errors import fail, reports_user_errors
from spec_cli.help import ReadableCommand
from spec_cli.prefixes import PrefixGroup

convert_app = typer.Typer(no_args_is_help=True, rich_markup_mode="rich", cls=PrefixGroup,
                          context_settings={"help_option_names": ["-h", "--help"]})
HELP = "Prepare speculative decoding inputs: FR-Spec token maps, EAGLE / EAGLE-3 drafts, and EAGLE-3 heads trained here."

_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

GEN = "Generation"
TRAIN = "Training"

Model = Annotated[str, typer.Option("--model", "--model-path", "-m", show_default=False,
                                    help="Target model: a Hugging Face directory, a .gguf file, a hub id or a known name.")]
Device = Annotated[Literal["auto", "cpu", "cuda"], typer.Option(
    "--device", help="Where to run the target (and the training): auto picks cuda when available.")]
Dtype = Annotated[Literal["auto", "float32", "bfloat16", "float16"], typer.Option(
    "--dtype", help="The target's dtype (auto: as spec serve picks it).")]
Prompts = Annotated[Optional[list[str]], typer.Option(
    "--prompts", "--dataset", "-d", show_default=False, rich_help_panel=GEN,
    help="Prompt source, repeatable: mt-bench, gsm8k, humaneval, sharegpt, instructions (built-in MT-Bench-like "
         "requests), magpie (requests the target writes itself from its chat template; needs a chat model and, "
         "for token-map, --from-generations), magpie-tasks (the same, each request begun with a task word in "
         "turn: Write, Solve, Pretend, Extract, ...), or a question.jsonl / ShareGPT .json / text file (one prompt a line).")]
NumPrompts = Annotated[Optional[int], typer.Option("--num-prompts", "-n", min=1, rich_help_panel=GEN,
                                                   help="Use this many prompts, taken from the sources in turn.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", min=1, rich_help_panel=GEN, help="Longest answer generated.")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, rich_help_panel=GEN,
                                            help="Sampling temperature of the answers; 0 is greedy.")]
GenBatch = Annotated[int, typer.Option("--gen-batch", min=1, rich_help_panel=GEN,
                                       help="Requests decoded together while generating.")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", min=1, show_default=False,
    help="CPU threads for torch (default: all cores). On a machine busy with other work, 1 can be several times faster.")]


# ------------------------------------------------------------------------------------------------ token-map
@convert_app.command("token-map", cls=ReadableCommand)
@reports_user_errors
def token_map(
    model: Model,
    dataset: Prompts = None,
    size: Annotated[int, typer.Option("--size", "--top", min=1, help="Token ids in the map.")] = 32768,
    output: Annotated[Optional[Path], typer.Option("--output", "--out", "-o", metavar="FILE.pt", show_default=False,
                                                   help="Where to save the map (default freq_SIZE.pt).")] = None,
    from_generations: Annotated[bool, typer.Option(
        "--from-generations", rich_help_panel=GEN,
        help="Count the target's own answers to the dataset's prompts (what the draft will see) instead of "
             "the dataset's texts.")] = False,
    num_prompts: NumPrompts = None,
    max_new_tokens: MaxNew = 256,
    temperature: Temperature = 0.0,
    gen_batch: GenBatch = 64,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
) -> None:
    """Build an FR-Spec token map: the corpus's most frequent token ids, for --speculative-token-map.

    Counts the tokens of a corpus (every text of a question.jsonl, ShareGPT file or text file), or with --from-generations the target's own answers to its prompts, and saves the top --size ids by descending frequency as a torch.save'd list (FR-Spec's format). EOS and the chat template's special tokens are always in it. Prints the share of the counted tokens the map covers.

    [bold]Examples[/bold]
      spec convert token-map --model smollm2-135m --dataset mt-bench --size 8192 -o freq_8192.pt
      spec convert token-map --model M --dataset gsm8k --from-generations -n 500 --size 16384
    """
    from engine.build import eos_token_ids
    from spec_tools.convert import magpie
    from spec_tools.convert.token_map import (build_token_map, chat_special_ids, corpus_counts, coverage,
                                          generation_counts, save_token_map)
    from engine.loader import load_config, load_tokenizer, resolve_model_path

    sources = dataset or ["mt-bench"]
    output = output or Path(f"freq_{size}.pt")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if from_generations:
        from spec_tools.convert.corpus import load_prompts, written_share
        from spec_tools.convert.generate import Generation, generation_engine

        engine = generation_engine(model, gen_batch, max_new_tokens, dtype, device)
        written = {}
        count = written_share(sources, num_prompts, magpie.sources(sources))
        for source in magpie.sources(sources):
            with _Bar(f"the target writing {count} prompts ({source})") as bar:
                written[source], _ = magpie.write_prompts(
                    engine, count, magpie.settings(source, str(engine.model_dir)), gen_batch, bar.advance)
        prompts = load_prompts(sources, num_prompts, written)
        if num_prompts and len(prompts) < num_prompts:
            _err.print(f"-n {num_prompts}: {', '.join(sources)} hold {len(prompts)} prompts; counting those")
        model_dir, config, tokenizer, eos = engine.model_dir, engine.model_config, engine.tokenizer, engine.eos_ids
        with _Bar(f"generating answers to {len(prompts)} prompts (tokens)") as bar:
            counts = generation_counts(engine, prompts, Generation(max_new_tokens, temperature), gen_batch,
                                       on_tokens=bar.advance)
        what = f"tokens the target generated for {len(prompts)} prompts"
    elif magpie.sources(sources):
        fail(f"--dataset {magpie.sources(sources)[0]} has the target write prompts, so its texts are generations: "
             "add --from-generations.")
    else:
        model_dir = resolve_model_path(model)
        config, tokenizer = load_config(model_dir), load_tokenizer(model_dir)
        eos = eos_token_ids(model_dir, config, tokenizer)
        counts = corpus_counts(tokenizer, sources, config.vocab_size)
        what = f"tokens of {', '.join(sources)}"
    if int(counts.sum()) == 0:
        fail(f"The corpus {', '.join(sources)} holds no tokens; pass a dataset with text.")
    ids = build_token_map(counts, size, chat_special_ids(tokenizer, eos))
    save_token_map(ids, output)
    seen = int((counts > 0).sum())
    _out.print(f"Wrote {output}: {len(ids)} token ids ({min(seen, len(ids))} seen in the corpus"
               f"{', the rest by id order' if seen < len(ids) else ''}).")
    _out.print(f"They cover {coverage(counts, ids):.2%} of the {int(counts.sum()):,} {what}.")
    if _servable(config):
        _out.print(f"Serve with: spec serve --model {model} --algo STANDALONE --draft D --speculative-token-map "
                   f"{output} (D a smaller model with this tokenizer; or --algo EAGLE or MTP with their drafts)")
    else:
        _out.print(f"The engine does not serve {config.model_type} targets: the map is for another engine, or a target "
                   "with this tokenizer.")


# ------------------------------------------------------------------------------------------------ draft
@convert_app.command("draft", cls=ReadableCommand)
@reports_user_errors
def draft(
    source: Annotated[str, typer.Argument(metavar="SOURCE", show_default=False,
                                          help="The draft checkpoint: a local directory or a hub id.")],
    model: Model,
    output: Annotated[Optional[Path], typer.Option("--output", "--out", "-o", metavar="DIR", show_default=False,
                                                   help="Directory to write the converted draft to.")] = None,
    algorithm: Annotated[Optional[Literal["EAGLE", "EAGLE3"]], typer.Option(
        "--algo", "--speculative-algorithm", show_default=False,
        help="The draft's kind; detected from its config when not given.")] = None,
    token_map: Annotated[Optional[Path], typer.Option(
        "--token-map", metavar="FILE.pt", show_default=False,
        help="Apply an FR-Spec map: EAGLE-3 drafts get it as their vocabulary (d2t/t2d, lm_head rows); EAGLE "
             "drafts get it saved beside them for --speculative-token-map.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Validate against the target and print the report; "
                                                        "write nothing.")] = False,
) -> None:
    """Import an EAGLE or EAGLE-3 draft, validate it against its target, and write it for spec serve.

    Reads the EAGLE repo's layout (EAGLE-1/2), SGLang's LlamaForCausalLMEagle copies, EAGLE-3 drafts as the EAGLE repo and SpecForge publish them, and vLLM speculators EAGLE-3 drafts. Checks hidden size, vocabulary, auxiliary layer ids and the embedding copy against the target, prints the report, and writes config.json + model.safetensors (checked by loading them as spec serve does).

    [bold]Examples[/bold]
      spec convert draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --model meta-llama/Llama-3.1-8B-Instruct -o drafts/eagle3
      spec convert draft ./eagle3 --model M --token-map freq_16384.pt -o drafts/eagle3-16k
      spec convert draft ./eagle-ckpt --model M --check
    """
    from spec_tools.convert.draft_io import apply_token_map, read_draft, validate, write_draft
    from engine.loader import iter_weights, load_config, resolve_model_path
    from engine.speculative.token_map import load_token_map

    if output is None and not check:
        fail("Pass --output DIR for the converted draft (or --check to validate only).")
    target_dir = resolve_model_path(model)
    target_config = load_config(target_dir)
    result = read_draft(source, algorithm)
    embedding = None
    if result.embedding is not None:
        name = "model.embed_tokens.weight"
        embedding = next((t for _, t in iter_weights(target_dir, select=lambda n: n == name)), None)
    if token_map is not None:
        apply_token_map(result, load_token_map(token_map, target_config.vocab_size).tolist(), target_config.vocab_size)
    checks = validate(result, target_config, embedding)
    _print_checks(f"{result.algorithm} draft, {result.layout} layout, against {model}", checks, result.notes)
    failed = [c.what for c in checks if c.status == "fail"]
    if failed:
        fail(f"The draft does not fit this target ({', '.join(failed)}); see the report above.")
    if check:
        return
    write_draft(result, output, target_config)
    _out.print(f"Wrote {output}. Serve with: spec serve --model {model} --algo {result.algorithm} --draft {output}"
               + (f" --speculative-token-map {output}/token_map.pt" if result.token_map is not None else ""))


def _print_checks(title: str, checks, notes) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("check", "draft", "target", ""):
        table.add_column(column)
    marks = {"ok": "[green]ok[/green]", "warn": "[yellow]warning[/yellow]", "fail": "[red]FAIL[/red]"}
    for c in checks:
        table.add_row(c.what, c.draft, c.target, marks[c.status])
    _out.print(table)
    for note in notes:
        _out.print(f"- {note}")


# ------------------------------------------------------------------------------------------------ training
@convert_app.command("train-eagle3", cls=ReadableCommand)
@reports_user_errors
def train_eagle3(
    model: Model,
    output: Annotated[Path, typer.Option("--output", "--out", "-o", metavar="DIR", show_default=False,
                                         help="Directory for the head (config.json + model.safetensors), its "
                                              "checkpoint, report and (by default) the training data.")],
    prompts: Prompts = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", "-n", min=1, rich_help_panel=GEN,
                                             help="Prompts answered by the target for training data.")] = 1024,
    max_new_tokens: MaxNew = 256,
    temperature: Temperature = 0.0,
    gen_batch: GenBatch = 64,
    data_dir: Annotated[Optional[Path], typer.Option(
        "--data-dir", metavar="DIR", show_default=False, rich_help_panel=GEN,
        help="Where the generated data lives (default OUTPUT/data); reused when it matches.")] = None,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", min=2, rich_help_panel=TRAIN,
                                             help="Tokens in the head's own vocabulary (d2t/t2d).")] = 8192,
    ttt_steps: Annotated[int, typer.Option("--ttt-steps", min=1, rich_help_panel=TRAIN,
                                           help="Draft steps unrolled in training (training-time test).")] = 4,
    intermediate_size: Annotated[Optional[int], typer.Option(
        "--intermediate-size", min=32, rich_help_panel=TRAIN, show_default=False,
        help="Width of the head's MLP, a multiple of 32 (default: the target's). A narrower head takes more steps "
             "in a --time-budget and drafts faster: measured in docs/convert.md.")] = None,
    epochs: Annotated[Optional[float], typer.Option(
        "--epochs", min=0.01, rich_help_panel=TRAIN, show_default=False,
        help="Passes over the data (default 4, or as many as --max-steps / --time-budget allow).")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=1, rich_help_panel=TRAIN, show_default=False,
                                                     help="Stop after this many optimizer steps.")] = None,
    time_budget: Annotated[Optional[float], typer.Option(
        "--time-budget", metavar="MINUTES", min=0.1, rich_help_panel=TRAIN, show_default=False,
        help="Stop training after this many minutes (generation not counted); the learning rate decays to fit.")] = None,
    batch_tokens: Annotated[int, typer.Option("--batch-tokens", min=16, rich_help_panel=TRAIN,
                                              help="Positions per batch (padded); smaller batches mean more optimizer steps per epoch.")] = 1024,
    lr: Annotated[float, typer.Option("--lr", min=0.0, rich_help_panel=TRAIN, help="Peak learning rate (AdamW).")] = 1e-3,
    save_every: Annotated[int, typer.Option("--save-every", min=1, rich_help_panel=TRAIN,
                                            help="Steps between checkpoints (each also a servable head).")] = 50,
    resume: Annotated[bool, typer.Option("--resume", rich_help_panel=TRAIN,
                                         help="Continue from OUTPUT/checkpoint.pt.")] = False,
    precision: Annotated[Literal["auto", "bf16", "fp32"], typer.Option(
        "--precision", rich_help_panel=TRAIN,
        help="Training compute: bf16 autocast or fp32; auto: bf16 where it is native (CUDA, AMX or AVX-512-BF16 "
             "CPUs), fp32 elsewhere (emulated bf16 is several times slower).")] = "auto",
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=TRAIN, help="Seed for the data order and the init.")] = 0,
    eval_prompts: Annotated[int, typer.Option(
        "--eval-prompts", min=0, help="Afterwards, measure the accept length on this many --eval-dataset prompts.")] = 0,
    eval_dataset: Annotated[str, typer.Option("--eval-dataset", help="Prompt source for --eval-prompts.")] = "mt-bench",
    eval_max_new_tokens: Annotated[int, typer.Option("--eval-max-new-tokens", min=1,
                                                     help="Tokens generated per --eval-prompts prompt.")] = 128,
    device: Device = "auto",
    dtype: Dtype = "auto",
    quantization: Annotated[Literal["auto", "none", "int4", "w8a8_int8", "w4a8"], typer.Option(
        "--quantization", rich_help_panel=GEN,
        help="The target's weight format while generating, as spec serve --quantization (auto: as spec serve picks "
             "it, so the head learns the target it will be served with). Another format can generate faster at batch "
             "64 (w8a8_int8 on AMX CPUs, dense bf16), its argmax a little off the served target's: measured in "
             "docs/convert.md. The data records it: data made otherwise is not reused.")] = "auto",
    threads: Threads = None,
) -> None:
    """Train an EAGLE-3 head for a target, on CPU or GPU, and save it in the EAGLE-3 layout.

    The target answers the prompts (on-policy data, as EAGLE-3 trains; by default half of them written by the target itself, magpie, half the built-in instructions) while its three auxiliary hidden states are kept on disk; then the one-layer head learns with training-time test (draft steps unrolled over its own outputs). Checkpoints every --save-every steps; --resume continues; interrupted generation resumes by itself. The result serves with --algo EAGLE3 --draft OUTPUT.

    [bold]Examples[/bold]
      spec convert train-eagle3 --model smollm2-135m -o drafts/smollm2-eagle3 -n 896 --time-budget 20 --eval-prompts 10
      spec convert train-eagle3 --model M -o heads/m --prompts sharegpt --num-prompts 20000 --epochs 2
      spec convert train-eagle3 --model M -o heads/m --resume
    """
    from spec_tools.convert.train_eagle3 import TrainOptions, train

    opts = TrainOptions(model=model, output=output, prompts=tuple(prompts or TrainOptions.prompts),
                        num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                        gen_batch=gen_batch, data_dir=data_dir, draft_vocab=draft_vocab, ttt_steps=ttt_steps,
                        intermediate_size=intermediate_size,
                        epochs=epochs, max_steps=max_steps, time_budget=time_budget, batch_tokens=batch_tokens,
                        lr=lr, save_every=save_every, resume=resume, device=device, dtype=dtype, quantization=quantization,
                        precision=precision,
                        seed=seed, eval_prompts=eval_prompts, eval_dataset=eval_dataset,
                        eval_max_new_tokens=eval_max_new_tokens, threads=threads)
    with _Bar() as bar:
        report = train(opts, bar)
    _print_training(report, output, model)


def _print_training(report: dict, output: Path, model: str) -> None:
    final = report["final"]
    table = Table(title=f"EAGLE-3 head for {model}: {report['steps']} steps, {report['epochs']} epochs, "
                        f"{report['training_s'] / 60:.1f} min training + {report['generation_s'] / 60:.1f} min data",
                  title_justify="left")
    table.add_column("draft step")
    table.add_column("loss")
    table.add_column("accuracy (top-1 vs target)")
    for i, (loss, acc) in enumerate(zip(final["step_loss"], final["accuracy"]), 1):
        table.add_row(str(i), f"{loss:.3f}", f"{acc:.1%}")
    _out.print(table)
    data = report["data"]
    _out.print(f"Data: {data['samples']} answers, {data['answer_tokens']:,} answer tokens; draft vocabulary "
               f"{report['draft_vocab']} tokens covering {report['vocab_coverage']:.1%} of them. "
               f"{report['s_per_step']:.2f} s/step on {report['device']}.")
    if "eval" in report:
        ev = report["eval"]
        _out.print(f"Accept length on {ev['prompts']} {ev['dataset']} prompts with tree {tuple(ev['tree'])}: "
                   f"[bold]{ev['avg_spec_accept_length']:.2f}[/bold] ({ev['output_tokens']} tokens).")
    _out.print(f"Wrote {output} (report: {output}/training_report.json). Serve with: "
               f"spec serve --model {model} --algo EAGLE3 --draft {output}")


class _Bar:
    """A rich progress bar for the phases of a conversion: description, bar, count, rate, ETA and the
    latest figures (loss, accuracy per draft step, seconds per step, tokens/s). Off a terminal (a log
    file) the same appears as a plain line every LOG_EVERY seconds."""

    LOG_EVERY = 30.0

    def __init__(self, description: Optional[str] = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"), console=_err, transient=False)
        self.task = self.progress.add_task(description, total=None, info="") if description else None
        self.logged = 0.0

    def __enter__(self) -> "_Bar":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def phase(self, name: str, total) -> None:
        self.task = self.progress.add_task(name, total=total, info="")

    def advance(self, n: float = 1, total=None, **info) -> None:
        shown = (f"{k.replace('_', '/')} {v:.1f}" if isinstance(v, float) else f"{k.replace('_', '/')} {v}"
                 for k, v in info.items())
        fields = {"info": "  ".join(shown)} if info else {}
        self.progress.update(self.task, advance=n, **({"total": total} if total is not None else {}), **fields)
        if not _err.is_terminal and time.monotonic() - self.logged >= self.LOG_EVERY:
            self.logged = time.monotonic()
            task = self.progress.tasks[self.task]
            eta = f"eta {task.time_remaining / 60:.1f} min" if task.time_remaining is not None else ""
            done = f"{task.completed:.0f}/{task.total:.0f}" if task.total else f"{task.completed:.0f}"
            _err.print(f"{task.description}: {done} {eta} {task.fields.get('info', '')}")

    def log(self, message: str) -> None:
        self.progress.console.print(message)


def _servable(config) -> bool:
    from engine.errors import ModelLoadError
    from engine.models import model_class

    try:
        model_class(config, "")
        return True
    except ModelLoadError:
        return False
