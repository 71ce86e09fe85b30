"""Read a resolved model directory: config, weights (one tensor at a time) and tokenizer.

transformers is imported inside functions: importing it takes seconds, which commands that never
load a model should not pay.
"""

from __future__ import annotations

import json
import re
import zipfile
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from engine.errors import ModelLoadError
from engine.loader import gguf_families
from engine.loader.fetch import KNOWN_MODELS
from engine.loader.safetensors_io import SafetensorsFile, reading
from engine.loader.source import resolve_model_path, weight_files


# Model types transformers lacks, read as the config of the family they extend (extra fields kept).
_EXTENDED_FAMILIES = {"mimo": "Qwen2Config"}     # Xiaomi MiMo: Qwen2 plus MTP layers


def load_config(model_dir: Path, trust_remote_code: bool = False):
    """The model's transformers config (a PretrainedConfig subclass)."""
    import transformers

    try:
        family = _EXTENDED_FAMILIES.get(_model_type(Path(model_dir)))
        if family:
            return getattr(transformers, family).from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
        return transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as e:  # OSError, ValueError (unknown model_type), JSON errors ...
        raise ModelLoadError(
            f"Cannot load {Path(model_dir) / 'config.json'}: {e}. Pass a model directory whose config.json "
            f"names a model type transformers knows (or add --trust-remote-code for custom code).") from e


def _model_type(model_dir: Path) -> Optional[str]:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None         # AutoConfig reports what is wrong


def iter_weights(model_dir: Path, select: Optional[Callable[[str], bool]] = None,
                 keep_fp8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint (or those whose name `select` accepts),
    named and typed as stored; a converted GGUF's quantized tensors (gguf_quant.gguf_groups) come
    dequantized to float32, as GGUF computes them, and so do an FP8 checkpoint's e4m3 weights (times their
    scales, which are not yielded; fp8_quant.paired), or with `keep_fp8` as fp8_quant.Fp8Weight; an MXFP4
    checkpoint's blocks and scales come as the bfloat16 tensor they store (mxfp4.dequantized).

    One tensor at a time (safetensors are memory-mapped), so the caller can cast and place each
    without holding a second copy of the model; tensors not selected are not read.
    """
    from engine.loader import fp8_quant, mxfp4

    quantization = fp8_quant.quantization_config(model_dir)
    if mxfp4.is_mxfp4(quantization):
        chosen = select and (lambda name: select(mxfp4.weight_name(name)))
        yield from mxfp4.dequantized(_iter_stored(model_dir, chosen))
        return
    checkpoint = fp8_quant.fp8_checkpoint(quantization, str(model_dir))
    if checkpoint is None:
        yield from _iter_stored(model_dir, select)
        return
    # A scale is read with its weight.
    chosen = select and (lambda name: select(fp8_quant.weight_name(name)))
    yield from fp8_quant.paired(_iter_stored(model_dir, chosen), checkpoint, keep_fp8)


def quantized_groups(model_dir: Path):
    """A checkpoint's weights that the CPU's quantized layers take as groups (gguf_quant.Groups, by
    weight name): a converted GGUF's own blocks, or an MXFP4 checkpoint's experts; None for others."""
    from engine.loader import fp8_quant, mxfp4
    from engine.loader.gguf_quant import gguf_groups

    if mxfp4.is_mxfp4(fp8_quant.quantization_config(model_dir)):
        return mxfp4.ExpertGroups(f for f in weight_files(Path(model_dir)) if f.suffix == ".safetensors")
    return gguf_groups(model_dir)


def _iter_stored(model_dir: Path, select: Optional[Callable[[str], bool]]) -> Iterator[tuple[str, torch.Tensor]]:
    from engine.loader.gguf_quant import dequantize, gguf_groups

    for file in weight_files(Path(model_dir)):
        if file.suffix == ".safetensors":
            yield from _iter_safetensors(file, select)
        else:
            with reading(file):
                # mmap avoids reading the file twice; only zip-format checkpoints support it.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
            yield from ((name, t) for name, t in state.items() if select is None or select(name))
    if groups := gguf_groups(model_dir):
        yield from ((name, dequantize(groups(name))) for name in groups.names() if select is None or select(name))


def transformers_model(model_dir: Path, dtype: torch.dtype):
    """transformers' model of a resolved directory (for comparisons), its weights read by iter_weights:
    from_pretrained alone would leave a converted GGUF's quantized tensors, which model.safetensors does
    not hold, at random values. One expert's projections go into transformers' stacked experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(load_config(model_dir), dtype=dtype).eval()
    params, loaded = model.state_dict(), set()
    with torch.no_grad():
        for name, tensor in iter_weights(model_dir, select=lambda n: _destination(params, n) is not None):
            param, into = _destination(params, name)
            into.copy_(tensor)
            loaded.add(params[param].data_ptr())
    if missing := [n for n, t in params.items() if t.data_ptr() not in loaded]:     # a tied head: loaded
        raise ModelLoadError(f"{model_dir} lacks weights transformers' model needs: {', '.join(missing[:5])}.")
    return model


_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)")


def _destination(params: dict[str, torch.Tensor], name: str) -> Optional[tuple[str, torch.Tensor]]:
    """(parameter, where in it) a checkpoint tensor goes in transformers' model: the parameter itself, or
    for one expert's projection its part of the stacked experts ([experts, 2 I, H] gate then up, and
    [experts, H, I]; GPT-OSS's [experts, H, 2 I] gate and up alternating, [experts, I, H], and their
    biases); None for a tensor the model has no place for."""
    if name in params:
        return name, params[name]
    found = _EXPERT.fullmatch(name)
    if found is None:
        return None
    experts, part, leaf = found[1], found[3], found[4]
    stacked = f"{experts}.{'down' if part == 'down' else 'gate_up'}_proj{'_bias' if leaf == 'bias' else ''}"
    if stacked not in params:
        return None
    expert = params[stacked][int(found[2])]
    if f"{experts}.gate_up_proj_bias" in params:        # GPT-OSS
        expert = expert.T if leaf == "weight" else expert
        return stacked, {"gate": expert[0::2], "up": expert[1::2], "down": expert}[part]
    half = expert.shape[0] // 2
    return stacked, {"gate": expert[:half], "up": expert[half:], "down": expert}[part]


def _iter_safetensors(file: Path, select: Optional[Callable[[str], bool]]) -> Iterator[tuple[str, torch.Tensor]]:
    reader = SafetensorsFile(file)
    for name in reader.names():
        if select is None or select(name):
            yield name, reader.get(name)


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """The tokenizer (PreTrainedTokenizerBase) of a model directory, a .gguf file, a known name or a hub id."""
    from transformers import AutoTokenizer

    source, kwargs, reader = str(path), {}, nullcontext()
    local = Path(path).expanduser()
    if source in KNOWN_MODELS:  # its converted directory holds the tokenizer files
        source = str(resolve_model_path(source))
    elif local.is_file() and local.suffix == ".gguf":
        source, kwargs = str(local.parent), {"gguf_file": local.name}
        reader = gguf_families.readable()       # with the header keys transformers misreads hidden from it
    elif local.exists():
        source = str(local)
    try:
        with reader:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # OSError for missing files, ValueError for unknown tokenizer classes ...
        raise ModelLoadError(
            f"No tokenizer could be loaded from {path} ({e}). Pass a tokenizer path: a directory with "
            f"tokenizer.json or tokenizer_config.json, a .gguf file, or a hub id.") from e
