"""Tiny random models and a tiny byte-level tokenizer, built from configs, for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "def add(a, b):\n    return a + b\n",
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600 emoji and unicode text.",
    "one two three four five six seven eight nine ten",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A chat template that offers tools and writes calls in the Qwen / Hermes format, as Qwen2.5's does.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call these tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call></s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 20, vocab_size=320, min_frequency=2,
                            special_tokens=["<s>", "</s>", "<pad>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    return tok


def make_model(path: Path, arch: str = "llama", *, layers: int = 2, hidden: int = 64, vocab: int = 320,
               seed: int = 0, max_pos: int = 512, tie: bool = False, dtype=torch.float32,
               chat_template: str = CHAT_TEMPLATE, **extra):
    """Save a random model of `arch` (a key of the table below) with the tiny tokenizer; return its dir."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "granite": (tf.GraniteConfig, tf.GraniteForCausalLM), "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
           "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM), "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
           "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM), "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
           "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM), "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
           "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM)}
    config_cls, model_cls = cls[arch]
    config = config_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                        max_position_embeddings=max_pos, tie_word_embeddings=tie,
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, **extra)
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss"):
        config.head_dim = hidden // 4
    return _save_random(path, model_cls, config, seed, dtype, chat_template)


def make_deepseek(path: Path, *, version: int = 3, layers: int = 3, hidden: int = 64, vocab: int = 320, seed: int = 0,
                  max_pos: int = 512, q_lora: bool = True, nextn: int = 0, **extra):
    """A random DeepSeek-V3, or V2 (`version` 2: its softmax router, a token's experts from its best group
    unless `topk_method` says "greedy"), with the tiny tokenizer: MLA, MoE from layer 1 on (8 experts in 4
    groups, 2 groups (V2: 1) and 2 experts per token, a shared expert); `nextn` MTP layers declared (none
    saved)."""
    import transformers as tf

    config_cls, model_cls = {2: (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
                             3: (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[version]
    fields = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32 if q_lora else None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        vocab_size=vocab, max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    # V2's groups limit the choice only where a token takes more experts than groups.
    fields.update(dict(topk_method="group_limited_greedy", topk_group=1) if version == 2 else
                  dict(num_nextn_predict_layers=nextn))
    return _save_random(path, model_cls, config_cls(**{**fields, **extra}), seed, torch.float32)


def _save_random(path: Path, model_cls, config, seed: int, dtype, chat_template: str = CHAT_TEMPLATE) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    # Larger weights than the default init give peaked, varied distributions: greedy paths that do not
    # all collapse into one repeated token, and argmax far from ties. A routing bias that matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif name.endswith(("sinks", "router.bias")):     # GPT-OSS's: large enough to matter
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    path = Path(path)
    model.save_pretrained(path)
    make_tokenizer(path, chat_template)
    return path


def reference_greedy(model_dir: Path, prompt_ids: list[int], n: int, **load) -> list[int]:
    """Greedy decoding by full recomputation with transformers' own modeling: the ground truth. `load`:
    more from_pretrained arguments (a GGUF file's gguf_file=)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def reference_generate(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' own generate, token by token with its cache: where a model's RoPE
    changes with the sequence's length (LongRoPE, dynamic NTK), each token is rotated as it was when
    generated, which full recomputation (reference_greedy) does not reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None         # n tokens, EOS among them (as ignore_eos)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 40) -> list[list[int]]:
    """n prompts of random ids (3..299, clear of the special tokens) and random lengths in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lengths]


def tiny_engine(model_dir, algorithm=None, draft=None, tree=(3, 1, 4), **kw):
    """An Engine on a tiny model (fp32 unless `dtype` is given), speculative when `algorithm` is given
    (tree = steps, topk, tokens, drafted whole every step unless speculative_adaptive="on" is given),
    its Predicted Output chains sized by a pinned step cost (tests.planning) unless `planner` is given."""
    from engine import Engine
    from tests.planning import untimed

    spec = {}
    if algorithm:
        steps, topk, tokens = tree
        # Fixed trees: every step drafts and verifies the whole tree, unless a test asks for adaptive sizes.
        spec = dict(speculative_algorithm=algorithm, speculative_num_steps=steps, speculative_eagle_topk=topk,
                    speculative_num_draft_tokens=tokens, speculative_adaptive="off")
        if draft:
            spec["speculative_draft_model_path"] = str(draft)
    return Engine(model_path=str(model_dir), **{"dtype": "float32", "max_total_tokens": 4096, "planner": untimed,
                                                **spec, **kw})


def target_probs(logits, params, prompt, output=(), eos_ids=()):
    """The distribution one request samples from after prompt + output, through the engine's sampling."""
    from types import SimpleNamespace

    from engine.core.sampling import SamplingBatch

    req = SimpleNamespace(params=params, token_ids=list(prompt) + list(output), prompt_len=len(prompt), seed=0)
    return SamplingBatch([req] * logits.shape[0], list(eos_ids), logits.device).probs(logits)


def tiny_runner(model_dir, slots: int = 1024, rows: int = 8, dtype=torch.float32):
    """A ModelRunner on a model directory with its own KV pool, and the KV manager whose table it reads."""
    from engine.attention import create_backend
    from engine.loader import load_config
    from engine.memory.kv_manager import KVManager
    from engine.memory.kv_pool import KVPool
    from engine.core.model_runner import ModelRunner, kv_layout, load_model

    model = load_model(model_dir, load_config(model_dir), dtype, "cpu", 512)
    layers, heads, head_dim = kv_layout(model)
    pool = KVPool(layers, slots, heads, head_dim, dtype, "cpu")
    return ModelRunner(model, pool, create_backend("torch", "cpu", pool)), KVManager(slots, rows, 512, "cpu", radix=False)


def deep_schema(levels: int) -> str:
    """A JSON schema of objects nested `levels` deep, as text (json.dumps recurses past Python's limit)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + '}, "required": ["a"]}' * levels
