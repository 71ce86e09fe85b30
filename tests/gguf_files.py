"""Tiny GGUF files as llama.cpp writes them, for the loader's and the quantized formats' tests: a tokenizer
GGUF can carry, a tiny Llama, the file writer for each family llama.cpp writes that the engine serves (F32,
or chosen linears in a GGUF quantization, K types included), raw blocks of each quantization, and the
check that a converted directory reads as transformers dequantizes the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.loader import iter_weights

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
TEXTS = ["hello world, the quick brown fox", "speculative decoding drafts tokens", "def f(x): return x + 1"]


def gguf_tokenizer():
    """A tiny byte-level BPE tokenizer that GGUF files can carry."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 4, vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, tie: bool = False, hidden_size: int = 64, intermediate_size: int = 128,
               layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # 4 query heads on 2 KV heads, so the GGUF test exercises llama.cpp's Q/K permutation with GQA.
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                         max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(config).eval()


# llama.cpp's architecture for each model type it writes: Mixtral is "llama" with experts.
GGUF_ARCHS = {"llama": "llama", "mixtral": "llama", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
              "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}


def write_tiny_gguf(path: Path, model, tokenizer, linear_types: dict[str, str] | None = None,
                    stacked: bool = True) -> None:
    """Write `model` (of a type in GGUF_ARCHS) as llama.cpp's convert_hf_to_gguf.py would: F32 tensors (or,
    for the decoder's linears named in linear_types, e.g. {"q_proj": "Q4_1"}, that GGUF quantization;
    "gate_proj", "up_proj" and "down_proj" name the experts' too, MXFP4 among their types), a Llama's Q/K
    rows permuted, Gemma's norm weights stored as 1 + w, experts stacked into one tensor per projection
    (not `stacked`: a tensor per expert, as Mixtral files were written before April 2024; GPT-OSS's
    interleaved gate and up parted), the family's header (head size, windows, soft-caps, RoPE scaling,
    expert counts and sizes) and Phi-3's LongRoPE factors as tensors."""
    import gguf

    config = model.config
    arch = GGUF_ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    _write_header(writer, config, arch)
    _write_vocab(writer, tokenizer, config.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], config.num_hidden_layers)
    for hf_name, tensor in model.named_parameters():  # a tied lm_head once, as llama.cpp writes it
        for name, data, part in _gguf_tensors(hf_name, tensor.detach().float().numpy(), config, arch, names, stacked):
            kind = (linear_types or {}).get(part)
            if kind:
                quant = gguf.GGMLQuantizationType[kind]
                ours = {"Q4_K": quantize_k, "Q5_K": lambda w: quantize_k(w, 5), "Q6_K": quantize_q6_k}  # not in gguf-py
                blocks = ours.get(kind, lambda w: gguf.quants.quantize(w, quant))(data)
                writer.add_tensor(name, blocks, raw_dtype=quant)
            else:
                writer.add_tensor(name, data)
    if arch == "phi3" and config.rope_parameters.get("long_factor"):
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight",
                              np.array(config.rope_parameters[f"{which}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_header(writer, config, arch: str) -> None:
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3", "qwen3moe", "gpt-oss"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "phi3":          # a window of 0: none (Phi-4)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None) or arch == "gpt-oss":
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", config.intermediate_size))
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_vocab(writer, tokenizer, pad: int | None) -> None:
    import gguf

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for _, i in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]  # ["a", "b"] pairs
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if pad is not None:             # as the model's config has it (Phi-3's default lies past a tiny vocabulary)
        writer.add_pad_token_id(pad)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_tensors(hf_name: str, data: np.ndarray, config, arch: str, names, stacked: bool):
    """(GGUF name, data, the linear's part name or None) of one transformers parameter, as llama.cpp
    writes it: transformers' experts [E, 2I, H] and [E, H, I] as ffn_{gate,up,down}_exps [E, rows, K], or
    not `stacked` ffn_{gate,up,down}.{e} [rows, K]."""
    if arch == "gpt-oss" and ".experts." in hf_name:
        yield from _gpt_oss_experts(hf_name, data)
        return
    base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "weight")
    part = base.split(".")[-1]
    if base.endswith(("experts.gate_up_proj", "experts.down_proj")):
        block = names.get_name(base.replace("gate_up_proj", "down_proj")).rsplit(".", 1)[0]
        kinds = ("gate", "up") if part == "gate_up_proj" else ("down",)
        for which, weights in zip(kinds, np.split(data, len(kinds), axis=1)):
            if stacked:
                yield f"{block}.ffn_{which}_exps.weight", np.ascontiguousarray(weights), f"{which}_proj"
            else:
                yield from ((f"{block}.ffn_{which}.{e}.weight", np.ascontiguousarray(w), f"{which}_proj")
                            for e, w in enumerate(weights))
        return
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(part)
    if arch in ("gemma2", "gemma3") and base.endswith("norm"):
        data = data + 1             # Gemma's norms scale by 1 + w; llama.cpp stores the sum
    elif heads and arch == "llama":  # llama.cpp interleaves the two rotary halves of every head
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
        data = np.ascontiguousarray(data.reshape(-1, *data.shape[3:]))
    elif part == "shared_expert_gate":
        data = data[0]              # [1, H] stored as [H]
    yield f"{names.get_name(base)}.{suffix}", data, part if suffix == "weight" else None


def _gpt_oss_experts(hf_name: str, data: np.ndarray):
    """GPT-OSS's stacked experts ([experts, in, out], gate and up outputs alternating; biases [experts,
    out]) as llama.cpp writes them: ffn_{gate,up,down}_exps [experts, out, in] and their biases."""
    layer, last = hf_name.split(".")[2], hf_name.rsplit(".", 1)[1]
    proj, suffix = last.removesuffix("_bias"), "bias" if last.endswith("_bias") else "weight"
    if suffix == "weight":
        data = data.swapaxes(1, 2)
    parts = {"gate": data[:, 0::2], "up": data[:, 1::2]} if proj == "gate_up_proj" else {"down": data}
    for which, t in parts.items():
        yield f"blk.{layer}.ffn_{which}_exps.{suffix}", np.ascontiguousarray(t), \
            f"{which}_proj" if suffix == "weight" else None


def quantize_k(w: np.ndarray, bits: int = 4) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> Q4_K or (bits 5) Q5_K blocks (which gguf-py cannot write):
    per 32 weights a step and a min (the smaller of theirs and 0) in 6-bit multiples of the 256's d and
    dmin. Simpler than llama.cpp's search; the same format."""
    rows, nb, top = w.shape[0], w.size // 256, 2 ** bits - 1
    sub = w.reshape(nb, 8, 32).astype(np.float32)
    step, floor = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / top, -np.minimum(sub.min(-1), 0)
    d, dmin = ((t.max(-1) / 63).astype(np.float16) for t in (step, floor))
    sc, m = (np.round(t / np.where(s > 0, s, 1).astype(np.float32)[:, None]).clip(0, 63).astype(np.uint8)
             for t, s in ((step, d), (floor, dmin)))
    real_step, real_min = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
    q = np.round((sub + real_min[..., None]) / np.where(real_step > 0, real_step, 1)[..., None]).clip(0, top)
    q = q.astype(np.uint8)
    high = [(q[:, j] >> 4) << j for j in range(8)] if bits == 5 else []   # Q5_K: sub-block j's in bit j
    q = q.reshape(nb, 4, 2, 32) & 15                               # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             sc[:, 4:] & 15 | (m[:, 4:] & 15) << 4], 1)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), scales,
                             *([sum(high)] if high else []), (q[:, :, 0] | q[:, :, 1] << 4).reshape(nb, 128)], 1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> Q6_K blocks (which gguf-py cannot write): a scale per 16
    weights (their largest magnitude / 31) in int8 steps of the 256's d. Simpler than llama.cpp's search;
    the same format."""
    rows, nb = w.shape[0], w.size // 256
    sub = w.reshape(nb, 16, 16).astype(np.float32)
    d = (np.abs(sub).max(-1).max(-1) / 31 / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.round(np.abs(sub).max(-1) / 31 / np.where(d32 > 0, d32, 1)).clip(-128, 127).astype(np.int8)
    step = d32 * sc
    q = (np.round(sub / np.where(step > 0, step, 1)[..., None]).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(nb, 2, 4, 32)                                   # halves of 128, quarters of 32
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], -1)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(nb, 2)], 1)
    return blocks.reshape(rows, -1)


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of a [rows, cols] tensor: quantized from random weights, or for the K types (which
    gguf-py cannot quantize) random bytes, every one a valid block with finite fp16 scales; MXFP4 random
    bytes, exponents from the subnormal 2^-127 up to 2^120."""
    import gguf

    rng = np.random.default_rng(seed)
    kind_enum = gguf.GGMLQuantizationType[kind]
    if kind == "MXFP4":
        blocks = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(0, 248, len(blocks))
        blocks[:4, 0] = [0, 1, 2, 247]
        return blocks.reshape(rows, -1)
    if kind not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind_enum)
    size, scales = {"Q4_K": (144, slice(0, 4)), "Q5_K": (176, slice(0, 4)), "Q6_K": (210, slice(208, 210))}[kind]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    blocks[:, scales] = rng.uniform(0.001, 0.1, (len(blocks), blocks[:, scales].shape[1] // 2)
                                    ).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def transformers_gguf_weights(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantization of a GGUF file's tensors, under its names: the reference for
    what a converted directory's weights read as."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def assert_converted_as_transformers_reads(converted: Path, path: Path) -> None:
    """Every tensor reads (iter_weights) as transformers dequantizes it from the file, bit for bit, and
    one the directory keeps as the file's blocks is not also on disk as floats."""
    from engine.loader.gguf_quant import gguf_groups
    from engine.loader.safetensors_io import SafetensorsFile

    got, want = dict(iter_weights(converted)), transformers_gguf_weights(path)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    groups = gguf_groups(converted)
    floats = set(SafetensorsFile(converted / "model.safetensors").names())
    assert groups is not None and not floats & set(groups.names())
