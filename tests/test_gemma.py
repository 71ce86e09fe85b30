"""Gemma 2 and Gemma 3 text targets against transformers' own Gemma2ForCausalLM / Gemma3ForCausalLM on tiny
random checkpoints whose sliding window is shorter than the prompts: logits, greedy decoding, every
speculative algorithm lossless; and the real Gemma-3-270M GGUF (slow) against transformers on the same
converted checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.forward_batch import make_batch
from engine.models.gemma import GemmaForCausalLM
from tests.drafts import ALGOS, draft_setup
from tests.planning import untimed
from tests.tiny import make_model, random_prompts, reference_greedy, tiny_engine, tiny_runner

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
WINDOW = 8          # shorter than every prompt below, so that local layers see less than global ones
LOCAL_GLOBAL = ["sliding_attention", "sliding_attention", "full_attention"]
# Values far from the defaults, so that a family file that ignored one would not pass: the attention
# scale apart from head_dim (16), soft-caps that bite, Gemma 3's two RoPE bases with the global one scaled.
FAMILIES = {
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
}


def make_gemma(path: Path, arch: str, **config) -> Path:
    """A tiny random `arch` checkpoint with tied embeddings, its norms' weights random too (stored around 0,
    read as 1 + w) and its embedding shrunk: scaled by sqrt(hidden) and tied to the head, the default one
    makes every greedy step repeat its input token. `config` overrides the layers and config fields."""
    from safetensors.torch import load_file, save_file

    config = {"layers": 3, "layer_types": LOCAL_GLOBAL, "query_pre_attn_scalar": 24, **FAMILIES[arch], **config}
    path = make_model(path, arch, tie=True, sliding_window=WINDOW, **config)
    weights, gen = load_file(path / "model.safetensors"), torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
        elif name == "model.embed_tokens.weight":
            tensor.mul_(0.15)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, tmp_path_factory):
    return make_gemma(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_transformers(gemma):
    """Two prompts in one batch, past the window: every position's logits are transformers' own."""
    from transformers import AutoModelForCausalLM

    runner, kv = tiny_runner(gemma)
    assert isinstance(runner.model, GemmaForCausalLM)
    ref = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    a, b = random_prompts(2, seed=1, lo=20, hi=60)
    batch = make_batch(kv.table, [0, 1], [0, 0], a + b, kv.alloc(len(a) + len(b)), [len(a), len(b)])
    with torch.no_grad():
        out = runner.forward(batch, all_logits=True)
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    torch.testing.assert_close(out.logits[:len(a)], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[len(a):], ref_b, atol=1e-5, rtol=1e-5)


def test_greedy_is_transformers(gemma):
    prompts = random_prompts(3, seed=2, lo=WINDOW + 2, hi=30)
    outs = tiny_engine(gemma).generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [reference_greedy(gemma, p, GREEDY["max_new_tokens"]) for p in prompts]


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_is_lossless(gemma, algo, tmp_path):
    prompts = random_prompts(4, seed=3, lo=WINDOW + 2, hi=30)
    expected = [o["output_ids"] for o in tiny_engine(gemma).generate(input_ids=prompts, sampling_params=GREEDY)]
    spec = draft_setup(algo, gemma, tmp_path)
    eng = tiny_engine(spec.pop("model_path", gemma), algo, tree=(3, 2, 5), **spec)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected


def test_embedding_gemma_is_refused(gemma, tmp_path):
    """A bidirectional Gemma (EmbeddingGemma) has the same weights but is no causal LM: refused by name."""
    import json
    import shutil

    from engine import ModelLoadError

    model = shutil.copytree(gemma, tmp_path / "bidirectional")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ModelLoadError, match="EmbeddingGemma"):
        tiny_engine(model)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_converts_to_the_model_written(arch, tmp_path, monkeypatch):
    """A tiny Gemma written as llama.cpp writes it (norms stored as 1 + w, no attention scale, layer types or
    local RoPE base in the header: llama.cpp's rules fix them) serves as the checkpoint it was written from."""
    from transformers import AutoModelForCausalLM

    from engine import Engine
    from tests.gguf_files import gguf_tokenizer, write_tiny_gguf

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = gguf_tokenizer()
    # llama.cpp's rules: layer types by the family's pattern (Gemma 3: every 6th global), scale 1/sqrt(head_dim),
    # Gemma 3's local base 10000.
    layers = {"gemma2": {"layers": 3}, "gemma3": {"layers": 6, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}}[arch]
    source = make_gemma(tmp_path / "hf", arch, vocab=len(tokenizer), layer_types=None, query_pre_attn_scalar=16,
                        **layers)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), tokenizer)
    prompts = random_prompts(2, seed=4, lo=WINDOW + 2, hi=30)
    with Engine(planner=untimed, model_path=str(path), dtype="float32", max_total_tokens=2048) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert outs == [reference_greedy(source, p, GREEDY["max_new_tokens"]) for p in prompts]


# A prompt past the real model's sliding window (512), so that its local layers see less than the global ones.
LONG_PROMPT = " ".join(f"Item {i}: the {i}th fruit in the basket is a {'pear' if i % 3 else 'plum'}." for i in range(40))


@pytest.mark.slow
@pytest.mark.parametrize("text", ["The capital of France is", LONG_PROMPT], ids=["short", "past-the-window"])
def test_gemma3_270m_gguf_is_transformers(text):
    """The fetched Gemma-3-270M GGUF served dequantized (--dtype float32) gives transformers' greedy tokens
    on the same file (transformers dequantizes it too)."""
    from transformers import AutoTokenizer

    from engine import Engine
    from engine.loader import KNOWN_MODELS, models_dir

    path = models_dir() / "gemma3-270m" / KNOWN_MODELS["gemma3-270m"].filename
    if not path.is_file():
        pytest.skip(f"{path} not fetched (spec fetch gemma3-270m)")
    prompt = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(text).input_ids
    assert text == "The capital of France is" or len(prompt) > 512
    with Engine(planner=untimed,
                model_path=str(path), dtype="float32", max_total_tokens=4096, context_length=4096) as eng:
        out = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20})["output_ids"]
    assert out == reference_greedy(path.parent, prompt, 20, gguf_file=path.name)
