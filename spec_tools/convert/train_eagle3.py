"""Train an EAGLE-3 head for a target, on CPU or GPU, and save it in the EAGLE-3 layout.

1. Data (eagle3_data.py): the target answers the prompts (on-policy, as EAGLE-3 trains), keeping its
   auxiliary and final hidden states; shards on disk, resumed and reused.
2. Vocabulary: the `draft_vocab` most frequent answer tokens (plus EOS and the chat template's special
   tokens) become the draft's own lm_head rows (d2t/t2d).
3. Head: engine/models/eagle.py's Eagle3Draft, its final norm and lm_head rows copied from the target
   (so its first outputs already live in the target's output space), fc passing the deepest auxiliary
   state through, the rest initialised as Hugging Face initialises Llama. The target's embedding and
   lm_head stay frozen.
4. Training (ttt.py): AdamW, linear warmup then cosine decay over the planned steps (or the time
   budget, whichever ends first), gradient clipping, bf16 autocast where bf16 is native (fp32
   elsewhere); length-bucketed batches of about `batch_tokens` fed positions. Every `save_every` steps
   a checkpoint (model, optimiser, position in the data) and a servable export are written; `resume`
   continues from the checkpoint.
Output directory: config.json + model.safetensors (the head, as SpecForge writes it: fc, midlayer.*,
norm, lm_head, d2t, t2d), checkpoint.pt, training_report.json, data/ (unless data_dir says otherwise).
"""

from __future__ import annotations

import json
import math
import random
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Protocol, Sequence

import torch

from spec_tools.convert import ConvertError, magpie
from spec_tools.convert.data_manifest import DataSpec, check_settings, data_shards, open_data, stored_prompts
from spec_tools.convert.eagle3_data import HEALTHY_AGREEMENT, Sample, answer_agreement, generate_data, load_samples
from spec_tools.convert.generate import Generation, chat_prompt_ids, generation_engine, generation_format
from spec_tools.convert.token_map import build_token_map, chat_special_ids, count_ids, coverage, eagle3_vocab
from spec_tools.convert.ttt import collate, unrolled_loss

# Samples shuffled together before being sorted by length into batches: batches change every epoch
# while padding stays small.
_BUCKET = 64


@dataclass
class TrainOptions:
    model: str
    output: Path
    prompts: tuple[str, ...] = ("magpie", "instructions")   # measured best on MT-Bench (docs/convert.md)
    num_prompts: int = 1024
    max_new_tokens: int = 256
    temperature: float = 0.0
    gen_batch: int = 64
    data_dir: Optional[Path] = None
    draft_vocab: int = 8192
    ttt_steps: int = 4
    intermediate_size: Optional[int] = None   # the head's MLP width (default: the target's)
    epochs: Optional[float] = None            # default: 4, unless max_steps or time_budget bounds the run
    max_steps: Optional[int] = None
    time_budget: Optional[float] = None       # minutes of training (the data phase not counted)
    batch_tokens: int = 1024
    lr: float = 1e-3
    warmup: float = 0.03                      # share of the planned steps
    grad_clip: float = 0.5
    decay: float = 0.8
    save_every: int = 50
    resume: bool = False
    device: str = "auto"
    dtype: str = "auto"                       # the target's dtype while generating and evaluating
    quantization: str = "auto"                # the generating target's weight format (generate.generation_format)
    precision: str = "auto"                   # training compute: bf16 autocast, fp32, or auto (bf16 where native)
    seed: int = 0
    eval_prompts: int = 0
    eval_dataset: str = "mt-bench"
    eval_max_new_tokens: int = 128
    threads: Optional[int] = None             # torch CPU threads (default: all cores)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir) if self.data_dir else Path(self.output) / "data"


class Progress(Protocol):
    def phase(self, name: str, total: Optional[float]) -> None: ...

    def advance(self, n: float = 1, total: Optional[float] = None, **info) -> None: ...

    def log(self, message: str) -> None: ...


class Silent:
    def phase(self, name, total):
        pass

    def advance(self, n=1, total=None, **info):
        pass

    def log(self, message):
        pass


# ------------------------------------------------------------------------------------------------ the run
def train(opts: TrainOptions, progress: Optional[Progress] = None) -> dict:
    """Generate (or reuse) the data, train, save; returns the report also written as training_report.json."""
    from engine.loader import load_config, resolve_model_path
    from engine.core.model_runner import resolve_device

    progress = progress or Silent()
    if opts.intermediate_size is not None and opts.intermediate_size % 32:
        # The w4a8 kernel, which serves the head with --speculative-draft-model-quantization w4a8, takes
        # groups of 32 along the down projection's input.
        raise ConvertError(f"--intermediate-size {opts.intermediate_size} is not a multiple of 32; pass e.g. "
                           f"{max(32, opts.intermediate_size // 32 * 32)}.")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = resolve_device(opts.device)
    output = Path(opts.output)
    checkpoint_path = output / "checkpoint.pt"
    if checkpoint_path.exists() and not opts.resume:
        raise ConvertError(f"{output} already holds a training checkpoint; pass --resume to continue it, or "
                           "another --output.")
    if opts.resume and not checkpoint_path.exists():
        raise ConvertError(f"--resume: {checkpoint_path} does not exist; drop --resume to start a new training.")
    target_dir = resolve_model_path(opts.model)
    config = load_config(target_dir)
    aux = _aux_layers(config, target_dir)

    started = time.perf_counter()
    samples = _data(opts, target_dir, aux, device, progress)
    generation_s = time.perf_counter() - started

    counts = count_ids((s.ids[s.prompt_len:].tolist() for s in samples), config.vocab_size)
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True) if opts.resume else None
    if state is not None:
        _check_resumable(state, opts)
        vocab_ids = state["vocab"].tolist()
    else:
        vocab_ids = _vocabulary(target_dir, config, counts, opts.draft_vocab)
    target_ids, d2t, t2d = eagle3_vocab(vocab_ids, config.vocab_size)
    progress.log(f"draft vocabulary: {len(target_ids)} tokens covering {coverage(counts, target_ids.tolist()):.1%} "
                 f"of the {int(counts.sum())} answer tokens")

    embed, head, norm = _target_tensors(target_dir, config)
    max_len = max(s.fed for s in samples)
    draft_config = make_draft_config(config, aux, len(target_ids), opts.intermediate_size)
    draft = new_draft(draft_config, aux, max_len + opts.ttt_steps + 2, head[target_ids], norm, opts.seed)
    draft.to(device)
    embed, head_rows, t2d_dev = embed.to(device), head[target_ids].to(device), t2d.to(device)

    trainer = _Trainer(opts, draft, embed, head_rows, t2d_dev, samples, device)
    if state is not None:
        trainer.restore(state)
        if trainer.planned_done():
            raise ConvertError(f"--resume: the checkpoint has trained {trainer.step} steps, {trainer.elapsed / 60:.1f} "
                               "min: all that --epochs, --max-steps and --time-budget allow (they count every "
                               "run resumed so far). Raise them to train on.")
    trainer.run(progress, lambda: _save(output, draft, draft_config, target_ids, d2t, t2d, trainer))
    report = {
        "target": str(target_dir), "aux_layers_hf_indices": list(aux), "device": device,
        "draft_vocab": len(target_ids), "vocab_coverage": coverage(counts, target_ids.tolist()),
        "data": {"samples": len(samples), "fed_positions": sum(s.fed for s in samples),
                 "answer_tokens": int(counts.sum())},
        "generation_s": round(generation_s, 1), **trainer.summary(), "options": _jsonable(asdict(opts)),
    }
    if opts.eval_prompts:
        from spec_tools.convert.corpus import load_prompts

        progress.phase(f"evaluating on {opts.eval_prompts} {opts.eval_dataset} prompts", None)
        report["eval"] = {"dataset": opts.eval_dataset, "prompts": opts.eval_prompts,
                          **evaluate(opts.model, output, load_prompts([opts.eval_dataset], opts.eval_prompts),
                                     opts.eval_max_new_tokens, opts.device, opts.dtype, opts.quantization)}
    (output / "training_report.json").write_text(json.dumps(report, indent=2))
    return report


def _vocabulary(target_dir: Path, config, counts: torch.Tensor, size: int) -> list[int]:
    """The most frequent answer tokens, with EOS and the chat template's special tokens."""
    from engine.build import eos_token_ids
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    return build_token_map(counts, size, chat_special_ids(tokenizer, eos_token_ids(target_dir, config, tokenizer)))


def _aux_layers(config, target_dir) -> tuple[int, ...]:
    from engine.models.eagle import eagle3_aux_layers

    return eagle3_aux_layers(types.SimpleNamespace(), config.num_hidden_layers, str(target_dir))


def _data(opts: TrainOptions, target_dir: Path, aux, device: str, progress: Progress) -> list[Sample]:
    from spec_tools.convert.corpus import load_prompts, written_share

    engine = None

    def make_engine():
        nonlocal engine
        if engine is None:
            engine = generation_engine(str(target_dir), opts.gen_batch, opts.max_new_tokens, opts.dtype, device,
                                       opts.quantization)
        return engine

    spec = _data_spec(opts, target_dir, aux, device)
    check_settings(opts.data_path, spec)          # before magpie spends minutes writing prompts
    written = {}
    count = written_share(opts.prompts, opts.num_prompts, magpie.sources(opts.prompts))
    for source in magpie.sources(opts.prompts):
        progress.phase(f"the target writing {count} prompts ({source})", count)
        written[source] = ours = magpie.cached_prompts(
            opts.data_path / f"{source}.json", count, magpie.settings(source, str(target_dir), opts.seed),
            make_engine, opts.gen_batch, progress.advance)
        if len(ours) < count:
            progress.log(f"{source}: only {len(ours)} distinct requests of the {count} wanted")
    prompts = load_prompts(list(opts.prompts), opts.num_prompts, written)
    if len(prompts) < opts.num_prompts:
        progress.log(f"-n {opts.num_prompts}: {', '.join(opts.prompts)} hold {len(prompts)} prompts; training on "
                     "those (add a source, e.g. --prompts magpie, for more)")
    manifest = open_data(opts.data_path, spec, prompts)
    stored, new_from = stored_prompts(manifest), None
    if stored < len(prompts):
        progress.phase(f"generating answers to {len(prompts) - stored} prompts"
                       + (f" (after the {stored} in {opts.data_path})" if stored else ""), len(prompts) - stored)
        started, tokens = time.perf_counter(), [0]

        def on_step(new_tokens: int, finished: int) -> None:
            tokens[0] += new_tokens
            progress.advance(finished, tok_s=tokens[0] / (time.perf_counter() - started))

        new_from = sum(shard["samples"] for shard in manifest["shards"])
        manifest = generate_data(make_engine(), prompts, opts.data_path, manifest, 4 * opts.gen_batch, on_step=on_step)
    elif stored > len(prompts):
        progress.log(f"using the first {len(prompts)} of the {stored} prompts answered in {opts.data_path}")
    shards = data_shards(opts.data_path, manifest, len(prompts))
    samples = load_samples(shards)
    if not samples:
        raise ConvertError(f"No training samples in {opts.data_path}: every generation failed.")
    if new_from is not None:
        _check_answers(engine, samples[new_from:], opts.data_path, progress)
    return samples


def _check_answers(engine, samples: list[Sample], data_path: Path, progress: Progress) -> None:
    """Refuse to train on answers that are not the target's: a few new samples fed back to it."""
    agreement = answer_agreement(engine, samples)
    if agreement is None:
        return
    progress.log(f"the target's argmax agrees with the stored answers at {agreement:.1%} of checked positions")
    if agreement < HEALTHY_AGREEMENT:
        raise ConvertError(f"The answers generated into {data_path} are not what the target produces (its argmax "
                           f"agrees at {agreement:.0%} of their positions; healthy data: 96-100%). This is a bug in "
                           "spec: please report it. Delete the directory to generate the data again.")


def _data_spec(opts: TrainOptions, target_dir: Path, aux, device: str) -> DataSpec:
    from engine.loader import load_config

    dtype, quantization = generation_format(target_dir, load_config(target_dir), opts.quantization, opts.dtype, device)
    return DataSpec(str(target_dir), tuple(aux), Generation(opts.max_new_tokens, opts.temperature, opts.seed),
                    dtype, quantization)


def _target_tensors(target_dir: Path, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding, lm_head, final norm weight) of the target, in float32."""
    from engine.loader import iter_weights

    names = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
    got = {n: t.float() for n, t in iter_weights(target_dir, select=lambda n: n in names)}
    if "model.embed_tokens.weight" not in got or "model.norm.weight" not in got:
        raise ConvertError(f"{target_dir} lacks model.embed_tokens.weight or model.norm.weight; EAGLE-3 training "
                           "supports Llama-family targets (Llama, Qwen2/3, Mistral, SmolLM).")
    embed = got["model.embed_tokens.weight"]
    return embed, got.get("lm_head.weight", embed), got["model.norm.weight"]


# ------------------------------------------------------------------------------------------------ the head
_DRAFT_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta",
                      "rope_scaling", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")


def make_draft_config(target_config, aux: Sequence[int], draft_vocab: int, intermediate_size: Optional[int] = None):
    """The config of an EAGLE-3 head for this target: a one-layer Llama as SpecForge writes it, its MLP
    `intermediate_size` wide where given (the target's width otherwise)."""
    import transformers

    values = {k: v for k, v in target_config.to_dict().items() if k in _DRAFT_CONFIG_KEYS and v is not None}
    if intermediate_size:
        values["intermediate_size"] = intermediate_size
    values.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, draft_vocab_size=draft_vocab, target_hidden_size=target_config.hidden_size,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}, torch_dtype="float32")
    return transformers.LlamaConfig.from_dict(values)


def new_draft(config, aux: Sequence[int], max_positions: int, head_rows: torch.Tensor, norm: torch.Tensor, seed: int):
    from engine.models.eagle import Eagle3Draft

    torch.manual_seed(seed)
    draft = Eagle3Draft(config, tuple(aux), max_positions, fc_bias=False, qkv_bias=False,
                        draft_vocab=head_rows.shape[0])
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)
        draft.lm_head.weight.copy_(head_rows)
        draft.norm.weight.copy_(norm)
        # fc starts by passing the deepest auxiliary state through: the layer begins in the target's own late
        # residual stream, where norm + lm_head already read a near-final distribution, not a random mix.
        hidden, deepest = config.hidden_size, max(range(len(aux)), key=lambda i: aux[i])
        draft.fc.weight.zero_()
        draft.fc.weight[:, deepest * hidden:(deepest + 1) * hidden] = torch.eye(hidden)
    draft.rotary.float()
    return draft


def export_tensors(draft, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """The head's tensors named as published: q/k/v and gate/up split again."""
    out = {}
    for name, tensor in draft.state_dict().items():
        tensor = tensor.detach().float().cpu()
        if name.endswith("qkv_proj.weight"):
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split(draft.attention.split)):
                out[name.replace("qkv_proj", part)] = t.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                out[name.replace("gate_up_proj", part)] = t.contiguous()
        elif "rotary" not in name:
            out[name] = tensor.contiguous()
    out["d2t"], out["t2d"] = d2t, t2d
    return out


def _save(output: Path, draft, config, target_ids, d2t, t2d, trainer: "_Trainer") -> None:
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    _replace(output / "config.json", lambda p: p.write_text(config.to_json_string()))
    _replace(output / "model.safetensors",
             lambda p: save_file(export_tensors(draft, d2t, t2d), str(p), metadata={"format": "pt"}))
    _replace(output / "checkpoint.pt", lambda p: torch.save({**trainer.state(), "vocab": target_ids}, p))


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ the loop
# Options that change what a checkpoint means: a resumed run must keep them.
_RESUME_KEYS = ("draft_vocab", "ttt_steps", "intermediate_size", "batch_tokens", "seed", "model")


def _check_resumable(state: dict, opts: TrainOptions) -> None:
    saved = state.get("options", {})
    changed = [k for k in _RESUME_KEYS if saved.get(k) != _jsonable(getattr(opts, k))]
    if changed:
        raise ConvertError(f"--resume: the checkpoint was trained with other {', '.join(changed)} "
                           f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); pass the same values.")


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


@dataclass
class _Trainer:
    opts: TrainOptions
    draft: torch.nn.Module
    embed: torch.Tensor
    head_rows: torch.Tensor
    t2d: torch.Tensor
    samples: list[Sample]
    device: str
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed: float = 0.0
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.optimizer = torch.optim.AdamW([p for p in self.draft.parameters() if p.requires_grad],
                                           lr=self.opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.steps_per_epoch = len(self._plan(0))
        opts = self.opts
        self.precision = resolve_precision(opts.precision, self.device)
        epochs = opts.epochs if opts.epochs is not None or opts.max_steps or opts.time_budget else 4.0
        limits = ([math.ceil(epochs * self.steps_per_epoch)] if epochs is not None else []) + \
            ([opts.max_steps] if opts.max_steps else [])
        self.planned: Optional[int] = min(limits) if limits else None     # None: the time budget alone ends it
        self.window: list[tuple[float, list]] = []

    # -- data order: bucketed by length, reshuffled every epoch, reproducible for resume
    def _plan(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.opts.seed * 1_000_003 + epoch)
        order = list(range(len(self.samples)))
        rng.shuffle(order)
        batches = []
        for start in range(0, len(order), _BUCKET):
            bucket = sorted(order[start:start + _BUCKET], key=lambda i: self.samples[i].fed)
            current, longest = [], 0
            for i in bucket:
                n = self.samples[i].fed
                if current and max(longest, n) * (len(current) + 1) > self.opts.batch_tokens:
                    batches.append(current)
                    current, longest = [], 0
                current.append(i)
                longest = max(longest, n)
            batches.append(current)
        rng.shuffle(batches)
        return batches

    def _progress(self) -> float:
        budget = self.opts.time_budget
        by_time = self.elapsed / (budget * 60) if budget else 0.0
        return max(self.step / self.planned if self.planned else 0.0, by_time)

    def planned_done(self) -> bool:
        return self._progress() >= 1.0

    def _lr(self) -> float:
        warmup = max(1, round(self.opts.warmup * self._expected_total()))
        if self.step < warmup:
            return self.opts.lr * (self.step + 1) / warmup
        return self.opts.lr * 0.5 * (1 + math.cos(math.pi * min(self._progress(), 1.0)))

    def run(self, progress: Progress, save) -> None:
        progress.phase(f"training ({self.steps_per_epoch} batches an epoch, {self.precision})", self._expected_total())
        progress.advance(self.step)
        self.draft.train()
        autocast = torch.autocast(device_type="cuda" if self.device.startswith("cuda") else "cpu",
                                  dtype=torch.bfloat16, enabled=self.precision == "bf16")
        plan = self._plan(self.epoch)
        while not self.planned_done():
            if self.batch_in_epoch >= len(plan):
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                plan = self._plan(self.epoch)
            started = time.perf_counter()
            batch = collate([self.samples[i] for i in plan[self.batch_in_epoch]], self.opts.ttt_steps, self.t2d,
                            torch.float32, self.device)
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr()
            with autocast:
                loss, stats = unrolled_loss(self.draft, self.embed, self.head_rows, batch, self.opts.ttt_steps,
                                            self.opts.decay)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.opts.grad_clip)
            self.optimizer.step()
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            took = time.perf_counter() - started
            self.elapsed += took
            self._record(loss.item(), stats, took, batch.tokens)
            progress.advance(1, total=self._expected_total(), **self._display(took))
            if self.step % self.opts.save_every == 0:
                save()
        save()
        self.draft.eval()

    def _expected_total(self) -> int:
        """Planned steps, or fewer when the time budget will end training first (before the first step
        of a run bounded by time alone: a guess of 100)."""
        if not self.opts.time_budget:
            return self.planned
        if self.step == 0:
            return self.planned or 100
        by_time = max(self.step, int(self.opts.time_budget * 60 * self.step / self.elapsed))
        return min(self.planned, by_time) if self.planned else by_time

    def _record(self, loss: float, stats, took: float, tokens: int) -> None:
        self.window.append((loss, stats))
        self.window = self.window[-20:]
        if self.step % 10 == 0 or self.step == 1:
            self.history.append({"step": self.step, "loss": round(loss, 4), "lr": self._lr(),
                                 "s_per_step": round(took, 3), "tokens": tokens,
                                 "step_loss": [round(s.loss, 4) for s in stats],
                                 "accuracy": [round(s.accuracy, 4) for s in stats]})

    def _means(self) -> tuple[float, list[float], list[float]]:
        steps = max(len(s) for _, s in self.window)
        loss = sum(l for l, _ in self.window) / len(self.window)
        acc = [_mean([s[i].accuracy for _, s in self.window if len(s) > i]) for i in range(steps)]
        step_loss = [_mean([s[i].loss for _, s in self.window if len(s) > i]) for i in range(steps)]
        return loss, step_loss, acc

    def _display(self, took: float) -> dict:
        loss, _, acc = self._means()
        return {"loss": f"{loss:.3f}", "acc": "/".join(f"{a:.2f}" for a in acc), "s_step": f"{took:.2f}",
                "epoch": f"{self.epoch + self.batch_in_epoch / max(self.steps_per_epoch, 1):.2f}"}

    def summary(self) -> dict:
        loss, step_loss, acc = self._means() if self.window else (float("nan"), [], [])
        return {"precision": self.precision, "steps": self.step,
                "epochs": round(self.epoch + self.batch_in_epoch / max(self.steps_per_epoch, 1), 2),
                "training_s": round(self.elapsed, 1), "s_per_step": round(self.elapsed / max(self.step, 1), 3),
                "final": {"loss": round(loss, 4), "step_loss": [round(x, 4) for x in step_loss],
                          "accuracy": [round(x, 4) for x in acc], "over_last_steps": len(self.window)},
                "history": self.history}

    def state(self) -> dict:
        return {"draft": self.draft.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "elapsed": self.elapsed,
                "history": self.history, "options": _jsonable(asdict(self.opts)), "samples": len(self.samples)}

    def restore(self, state: dict) -> None:
        """Continue where the checkpoint stopped; onto data that grew (or shrank) since, with a new epoch
        over all of it, since the position in the old epoch's order means nothing in the new one."""
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.elapsed, self.history = state["elapsed"], state["history"]
        if state.get("samples", len(self.samples)) != len(self.samples) and self.batch_in_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0


def resolve_precision(name: str, device: str) -> str:
    from engine.models.prepack import native_bf16

    if name != "auto":
        return name
    return "bf16" if native_bf16(device) else "fp32"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(model: str, draft_dir: Path, prompts: Sequence[str], max_new_tokens: int, device: str = "auto",
             dtype: str = "auto", quantization: str = "auto") -> dict:
    """Greedy answers with the head as an EAGLE3 draft, the engine-wide acceptance. The tree is SGLang's
    auto tree for the target family on any device (a CPU serves a smaller one, which caps accept length at
    2), verified whole every step (no adaptive sizes): accept lengths measure the head, comparable across
    devices and with published ones."""
    from engine import Engine
    from engine.config import sglang_auto_tree
    from engine.loader import load_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    ids = chat_prompt_ids(load_tokenizer(path), prompts)
    steps, topk, tokens = sglang_auto_tree(load_config(path).model_type)
    # A KV pool sized for these requests (the default, a share of the machine's memory, is far larger).
    engine = Engine(model_path=model, dtype=dtype, device=device, quantization=quantization,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft_dir),
                    speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                    speculative_adaptive="off", max_total_tokens=sum(len(p) + max_new_tokens + 16 for p in ids))
    started = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    took = time.perf_counter() - started
    stats = engine.stats()
    summary = {k: stats[k] for k in ("spec_verify_ct", "avg_spec_accept_length", "spec_accept_rate",
                                     "spec_accept_by_position")}
    return {"tree": list(engine.args.speculative_tree), "output_tokens": sum(len(o["output_ids"]) for o in outs),
            "seconds": round(took, 1), **summary}
