"""Quantized weights: GGUF's 4-bit blocks decoded bit for bit, the int4/int8 linears against their
dequantized reference, a row's result independent of how many rows a call has (what verification
leans on), and engines on quantized weights: GGUF files served from their own 4-bit layers, and
speculative decoding lossless relative to the quantized target."""

from __future__ import annotations

import pytest
import torch

from engine.loader import gguf_quant
from engine.models.quant import Int4Linear, Int8Embedding, Int8GroupLinear, W4A8Linear, W8A8Linear, quantize_rows
from spec_kernels import cpu_w4a8
from tests.compiler import require
from tests.drafts import ALGOS, draft_setup
from tests.gguf_files import (assert_converted_as_transformers_reads, gguf_blocks, gguf_tokenizer, tiny_llama,
                              write_tiny_gguf)
from tests.lossless import prompts as lossless_prompts
from tests.planning import untimed
from tests.tiny import make_model, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "MXFP4"])
def test_gguf_blocks_decode_bit_exactly(kind, monkeypatch):
    """Also when dequantize works in slices of rows (5 of 3 rows here, a last one short)."""
    import gguf

    raw = gguf_blocks(kind, 14, 512)
    groups = gguf_quant.decode(raw, kind, 14)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(14, 512)
    assert torch.equal(gguf_quant.dequantize(groups), theirs)
    monkeypatch.setattr(gguf_quant, "_SLICE_BYTES", 3 * 512 * 4)
    assert torch.equal(gguf_quant.dequantize(groups), theirs)
    assert groups.bits == {"Q6_K": 6, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}.get(kind, 5)
    assert (groups.super is None) == (kind not in ("Q4_K", "Q5_K", "Q6_K"))


def test_int4_linear_computes_with_its_groups():
    """Built from groups (as from a GGUF), it multiplies by q * scale + min, scale and min in bf16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (96, 256), generator=g)
    scale, low = torch.rand(96, 8, generator=g) * 0.01, torch.randn(96, 8, generator=g) * 0.05
    bias = torch.nn.Parameter(torch.randn(96, generator=g))
    linear = Int4Linear(gguf_quant.pack(q.numpy()), scale, low, bias)
    dq = gguf_quant.dequantize(gguf_quant.Groups(4, gguf_quant.pack(q.numpy()), scale.bfloat16().float(),
                                                 (low + 8 * scale).bfloat16().float() - 8 * scale.bfloat16().float()))
    x = torch.randn(5, 256, generator=g)
    expected = x.bfloat16().float() @ dq.t() + bias
    assert (linear(x) - expected).abs().max() < 1e-2 * expected.abs().max()


@pytest.mark.parametrize("cls, tolerance", [(Int4Linear, 0.1), (W8A8Linear, 0.03), (W4A8Linear, 0.1),
                                                  (Int8GroupLinear, 0.03)])
def test_quantized_linear_approximates_the_float_one(cls, tolerance):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 256, generator=g) * 0.05, torch.randn(5, 256, generator=g)
    expected = x @ w.t()
    assert (cls.quantize(w, None)(x) - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.parametrize("cls", [Int4Linear, W8A8Linear, W4A8Linear, Int8GroupLinear])
def test_a_row_does_not_depend_on_the_rows_beside_it(cls):
    g = torch.Generator().manual_seed(1)
    linear = cls.quantize(torch.randn(64, 128, generator=g), None)
    x = torch.randn(16, 128, generator=g)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(16)])
    assert torch.equal(linear(x), alone) and torch.equal(linear(x[:8]), alone[:8])


def test_int8_embedding_looks_up_the_rows_the_head_multiplies_by():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 64, generator=g)
    q, scale = quantize_rows(w, slice_rows=128)           # slices that do not divide the rows
    embedding, head = Int8Embedding(q, scale, torch.float32), W8A8Linear(q, scale, None)
    ids = torch.tensor([0, 299, 7, 7])
    assert torch.equal(embedding(ids), embedding.dequantized()[ids])
    assert (embedding.dequantized() - w).abs().max() <= scale.max() / 2 + 1e-6      # half a step at most
    x = torch.randn(3, 64, generator=g)
    expected = x @ embedding.dequantized().t()
    assert (head(x) - expected).abs().max() < 0.03 * expected.abs().max()


@pytest.mark.parametrize("tie", [True, False])
def test_w8a8_keeps_the_embedding_and_head_as_int8_only(tie, tmp_path):
    """No float copy of the vocabulary is kept; the rows readers of the head get (token maps, EAGLE
    drafts) are the ones the logits are computed with."""
    model_dir = make_model(tmp_path / "m", "llama", seed=4, tie=tie)
    eng = tiny_engine(model_dir, quantization="w8a8_int8")
    model = eng.debug.target.model
    assert isinstance(model.model.embed_tokens, Int8Embedding) and isinstance(model.quant_head, W8A8Linear)
    assert not hasattr(model, "lm_head") or tie
    assert not any(p.numel() >= 320 * 64 for p in model.parameters())
    hidden = torch.randn(2, 64)
    reference = hidden @ model.lm_head_weight().t()
    assert (model.compute_logits(hidden) - reference).abs().max() < 0.03 * reference.abs().max()
    out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={**GREEDY, "max_new_tokens": 4})
    assert len(out[0]["output_ids"]) == 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("target"), "llama", seed=3)


@pytest.mark.parametrize("kind, dtype", [("int4", "float32"), ("w8a8_int8", "float32"), ("w4a8", "float32"),
                                         ("w4a8", "bfloat16")])     # bf16: the C elementwise kernels too
@pytest.mark.parametrize("algo", ALGOS)
def test_speculation_is_lossless_on_quantized_weights(kind, dtype, algo, target, tmp_path):
    prompts = lossless_prompts()         # a repetitive one among them: drafts get accepted
    spec = draft_setup(algo, target, tmp_path)
    model = spec.pop("model_path", target)
    plain = tiny_engine(model, quantization=kind, dtype=dtype)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = tiny_engine(model, algo, tree=(3, 2, 6), quantization=kind, dtype=dtype, **spec)
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    stats = eng.stats()
    assert stats["spec_verify_ct"] > 0 and (algo != "NGRAM" or stats["avg_spec_accept_length"] > 1)


def test_gguf_layers_are_kept_and_served_quantized(tmp_path, monkeypatch):
    """Q4_0 and Q4_1 layers (and a Q8_0 one): the converted directory keeps their groups bit-exactly
    (renamed and permuted as the dequantized copies); by default served as w4a8 (int4 without VNNI),
    every layer from its own groups (the Q8_0 one as 8-bit groups); with w8a8_int8 every decoder layer
    and the head as int8, with --dtype float32 the exact dequantized reference; all agree on the logits
    closely."""
    from engine import Engine
    from engine.core.forward_batch import make_batch
    from engine.loader import convert_gguf, iter_weights
    from engine.loader.gguf_quant import gguf_groups

    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))      # the conversion stays in this test
    tokenizer = gguf_tokenizer()
    model = tiny_llama(len(tokenizer))
    types = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q4_1", "gate_proj": "Q4_1",
             "up_proj": "Q4_1", "down_proj": "Q8_0"}
    path = tmp_path / "tiny-llama.Q4.gguf"
    write_tiny_gguf(path, model, tokenizer, types)
    converted = convert_gguf(path)
    assert_converted_as_transformers_reads(converted, path)
    groups, weights = gguf_groups(converted), dict(iter_weights(converted))
    assert groups("model.layers.0.mlp.down_proj.weight").bits == 8

    engines = {kw: Engine(planner=untimed, model_path=str(path), max_total_tokens=2048, **dict([kw])) for kw in
               (("quantization", "auto"), ("quantization", "w8a8_int8"), ("quantization", "w4a8"),
                ("quantization", "int4"), ("dtype", "float32"))}
    kinds = {kw: {type(m).__name__ for m in e.debug.target.model.modules()} for kw, e in engines.items()}
    auto = "w4a8" if cpu_w4a8.kernel_name() == "avx512-vnni" else "int4"
    assert kinds[("quantization", "auto")] == kinds[("quantization", auto)]
    int4_layer = engines[("quantization", "int4")].debug.target.model.model.layers[0]
    assert type(int4_layer.self_attn.qkv_proj).__name__ == type(int4_layer.mlp.down_proj).__name__ == "Int4Linear"
    w4a8_layer = engines[("quantization", "w4a8")].debug.target.model.model.layers[0]
    assert type(w4a8_layer.self_attn.qkv_proj) is W4A8Linear and type(w4a8_layer.mlp.down_proj) is Int8GroupLinear
    assert torch.equal(w4a8_layer.mlp.down_proj.dequantized(), weights["model.layers.0.mlp.down_proj.weight"])
    assert type(engines[("quantization", "w4a8")].debug.target.model.quant_head) is Int8GroupLinear
    assert "W8A8Linear" in kinds[("quantization", "w8a8_int8")]
    assert engines[("quantization", "w8a8_int8")].debug.target.model.quant_head is not None
    assert "Int8Embedding" in kinds[("quantization", "w8a8_int8")]
    assert not {"W8A8Linear", "Int4Linear"} & kinds[("dtype", "float32")]
    ids = tokenizer("the quick brown fox").input_ids
    logits = {}
    for kw, eng in engines.items():
        kv, runner = eng.debug.kv, eng.debug.target
        batch = make_batch(kv.table, [0], [0], ids, kv.alloc(len(ids)), [len(ids)])
        with torch.inference_mode():
            logits[kw] = runner.forward(batch, all_logits=True).logits.float()
    reference = logits[("dtype", "float32")]
    for kw in engines:
        assert (logits[kw] - reference).abs().max() < 0.05 * reference.abs().max(), kw
    # As a STANDALONE draft under w4a8 the Q8_0 layer and the head are 4-bit too (a draft's bits change
    # only acceptance); the output is the w4a8 target's.
    spec = Engine(planner=untimed,
                  model_path=str(path), max_total_tokens=2048, quantization="w4a8", speculative_algorithm="STANDALONE",
                  speculative_draft_model_path=str(path), speculative_draft_model_quantization="w4a8")
    draft = spec.debug.drafter.model
    assert type(draft.model.layers[0].mlp.down_proj) is W4A8Linear and type(draft.quant_head) is W4A8Linear
    assert type(spec.debug.target.model.model.layers[0].mlp.down_proj) is Int8GroupLinear
    plain = engines[("quantization", "w4a8")].generate(input_ids=[ids], sampling_params=GREEDY)
    assert spec.generate(input_ids=[ids], sampling_params=GREEDY)[0]["output_ids"] == plain[0]["output_ids"]


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_k_quant_layers_and_head_are_served_as_they_are(tie, tmp_path, monkeypatch):
    """Q4_K layers (gate/up) and embedding, a Q5_K one (o_proj), Q6_K ones (down_proj, v_proj beside Q4_K
    q/k) and an untied Q6_K head: the converted directory keeps their blocks bit-exactly; under w4a8 the target serves
    gate/up, o_proj, down_proj, the embedding and the head (a tied one from the embedding's groups) from
    them (W4A8Linear with Q4_K's own scales, Q5Linear, Q6KLinear, GroupEmbedding, the fused q/k/v's mixed parts
    chained in a MixedLinear: the file's weights exactly), and its logits are the float reference's
    within the activations' int8 rounding; a STANDALONE draft from the same file rounds the Q6_K ones to 4 bits and
    the output stays the target's."""
    from engine import Engine
    from engine.core.forward_batch import make_batch
    from engine.loader import convert_gguf, iter_weights
    from engine.models.quant import GroupEmbedding, MixedLinear, Q5Linear, Q6KLinear

    require(cpu_w4a8._kernel)
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = gguf_tokenizer()
    model = tiny_llama(len(tokenizer), tie=tie, hidden_size=256, intermediate_size=512)   # K quants: rows of 256s
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K", "lm_head": "Q6_K", "embed_tokens": "Q4_K"}
    path = tmp_path / "tiny-llama.Q6_K.gguf"
    write_tiny_gguf(path, model, tokenizer, types)
    converted = convert_gguf(path)
    assert_converted_as_transformers_reads(converted, path)
    weights = dict(iter_weights(converted))
    head_name = "model.embed_tokens.weight" if tie else "lm_head.weight"

    target = Engine(planner=untimed, model_path=str(path), max_total_tokens=2048, quantization="w4a8")
    reference = Engine(planner=untimed, model_path=str(path), max_total_tokens=2048, dtype="float32")
    served = target.debug.target.model
    assert type(served.model.layers[1].mlp.down_proj) is Q6KLinear
    o_proj = served.model.layers[1].self_attn.o_proj
    assert type(o_proj) is Q5Linear and torch.equal(o_proj.dequantized(), weights["model.layers.1.self_attn.o_proj.weight"])
    assert type(served.quant_head) is (W4A8Linear if tie else Q6KLinear)
    qkv = served.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is MixedLinear and [type(p) for p in qkv.parts] == [W4A8Linear, W4A8Linear, Q6KLinear]
    assert torch.equal(qkv.dequantized(), torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"]
                                                     for p in "qkv"]))
    assert torch.equal(served.quant_head.dequantized(), weights[head_name])
    embedding = served.model.embed_tokens
    assert type(embedding) is GroupEmbedding
    assert torch.equal(embedding.dequantized(), weights["model.embed_tokens.weight"].to(embedding.dtype))
    layer = served.model.layers[1].mlp
    assert torch.equal(layer.down_proj.dequantized(), weights["model.layers.1.mlp.down_proj.weight"])
    assert type(layer.gate_up_proj) is W4A8Linear and torch.equal(layer.gate_up_proj.dequantized(), torch.cat(
        [weights[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]))
    ids = tokenizer("the quick brown fox").input_ids
    logits = []
    for eng in (target, reference):
        kv, runner = eng.debug.kv, eng.debug.target
        batch = make_batch(kv.table, [0], [0], ids, kv.alloc(len(ids)), [len(ids)])
        with torch.inference_mode():
            logits.append(runner.forward(batch, all_logits=True).logits.float())
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[1].abs().max()

    spec = Engine(planner=untimed,
                  model_path=str(path), max_total_tokens=2048, quantization="w4a8", speculative_algorithm="STANDALONE",
                  speculative_draft_model_path=str(path), speculative_draft_model_quantization="w4a8")
    draft = spec.debug.drafter.model
    assert type(draft.model.layers[1].mlp.down_proj) is W4A8Linear and type(draft.quant_head) is W4A8Linear
    # rounded from the file's Q6_K blocks as from their float copy, which loading no longer reads
    down = weights["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(draft.model.layers[1].mlp.down_proj.dequantized(), W4A8Linear.quantize(down, None).dequantized())
    plain = target.generate(input_ids=[ids], sampling_params=GREEDY)
    assert spec.generate(input_ids=[ids], sampling_params=GREEDY)[0]["output_ids"] == plain[0]["output_ids"]


@pytest.mark.parametrize("kind", ["w4a8", "int4"])
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3"])
def test_draft_quantization_quantizes_the_draft_and_stays_lossless(kind, algo, target, tmp_path):
    """--speculative-draft-model-quantization acts on the draft's layers (a head's too); the output is
    still the plain target's."""
    if kind == "w4a8":
        require(cpu_w4a8._kernel)
    prompts = lossless_prompts()
    expected = [o["output_ids"] for o in tiny_engine(target).generate(input_ids=prompts, sampling_params=GREEDY)]
    eng = tiny_engine(target, algo, tree=(3, 2, 6), speculative_draft_model_quantization=kind,
                      **draft_setup(algo, target, tmp_path))
    assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    draft = eng.debug.drafter.model
    layer = draft.model.layers[0] if algo == "STANDALONE" else draft.midlayer
    assert type(layer.mlp.gate_up_proj) is (W4A8Linear if kind == "w4a8" else Int4Linear)
    assert eng.stats()["spec_verify_ct"] > 0


@pytest.mark.parametrize("target_kind,head_kind,w4a8_head", [("w4a8", "auto", True), ("w4a8", "none", False),
                                                             ("none", "auto", False)])
def test_auto_runs_a_head_in_w4a8_beside_a_w4a8_target(target_kind, head_kind, w4a8_head, target, tmp_path):
    """--speculative-draft-model-quantization auto: an EAGLE-3 head's layers, fc and own lm_head run in
    w4a8 when the target does, in the checkpoint's own weights otherwise or with none; the output is the
    target's either way."""
    require(cpu_w4a8._kernel)
    eng = tiny_engine(target, "EAGLE3", quantization=target_kind, speculative_draft_model_quantization=head_kind,
                      **draft_setup("EAGLE3", target, tmp_path))
    draft = eng.debug.drafter.model
    layer = draft.midlayer
    assert (type(layer.mlp.gate_up_proj) is W4A8Linear) == w4a8_head
    assert (type(layer.self_attn.qkv_proj) is W4A8Linear) == w4a8_head
    assert (type(draft.fc) is W4A8Linear) == w4a8_head
    assert (type(draft.head.matmul) is W4A8Linear) == w4a8_head
    if w4a8_head:       # the head's logits are its rows' within 4-bit rounding
        h = torch.randn(3, draft.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        reference = h.float() @ draft.lm_head.weight.float().T
        logits = draft.head(h)[:, draft.head.ids]
        assert (logits - reference).abs().max() <= 0.1 * reference.abs().max()
    plain = tiny_engine(target, quantization=target_kind)
    ids = lossless_prompts()[3:]
    params = {"temperature": 0, "max_new_tokens": 12}
    assert ([o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=params)]
            == [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=params)])
