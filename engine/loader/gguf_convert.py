"""GGUF file -> cached Hugging Face directory (config.json, model.safetensors, tokenizer files), plus
the file's own quantized weights (gguf_groups/groups.safetensors).

A GGUF is dequantized once with transformers' own GGUF reader (which also renames tensors and undoes
llama.cpp's Q/K row permutation) into an ordinary checkpoint, and its Q4_0/Q4_1/Q4_K, Q5_K, Q6_K and
Q8_0/Q5_0/Q5_1 tensors are also kept as they are (engine/loader/gguf_quant.py) under the same names,
renamed and permuted the same way: the engine serves those directly on the CPU (--quantization auto),
and the float checkpoint is the exact reference (--dtype float32). Later runs reuse the directory.
transformers and gguf are imported inside functions: importing them takes seconds, which commands that
never convert should not pay.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

# In a folder of its own, so that the checkpoint's *.safetensors stay the float weights alone.
QUANT_FILE = "gguf_groups/groups.safetensors"
# Bumped when what a conversion writes changes: older cached directories are converted again.
_FORMAT = 6


def converted_root() -> Path:
    base = os.environ.get("SPEC_CACHE_DIR") or Path.home() / ".cache" / "spec"
    return Path(base).expanduser() / "converted"


def convert_gguf(gguf_path: Path) -> Path:
    """Return the cached HF directory for `gguf_path`, converting it the first time."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist. Pass the path of an existing .gguf file.")
    stat = path.stat()
    # Size and mtime in the name: a re-fetched or edited file gets a fresh conversion.
    out = converted_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_FORMAT}"
    if out.is_dir():  # only ever created by the atomic rename below, so it is complete
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        logger.info("Converting %s to %s (once; later runs reuse it)", path, out)
        with _parse_once():
            _convert_into(path, _stored_dtype(path), tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():
                raise
            # Another process finished the same conversion first; its result is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in out.parent.glob(f"{glob.escape(out.name.rsplit('-v', 1)[0])}-v*"):
        if stale != out:            # an older format's copy of the same file (a 1.5B model's is ~6 GB)
            logger.info("Removing %s, converted by an older version", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return out


@contextmanager
def _parse_once():
    """Make every `gguf.GGUFReader(path)` in this block share one parsed reader per file.

    transformers parses the whole header again for the config, the tensors and the tokenizer's
    config; with a 150k-token vocabulary each parse takes ~20 s on CPU, most of a conversion.
    It looks `gguf.GGUFReader` up at call time, so swapping the attribute is enough.
    """
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _stored_dtype(path: Path) -> torch.dtype:
    """float32 for quantized files (what dequantizing yields); a half type for plain f16/bf16 files.

    Reading the whole header and tensor table also rejects truncated or corrupt files up front.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    try:
        types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    except Exception as e:  # the reader raises ValueError, IndexError, ... on malformed bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({e}); it may be truncated or corrupt. "
            f"Fetch it again, or pass another .gguf file or a Hugging Face directory.") from e
    if not types:
        raise ModelLoadError(f"{path} holds no tensors. Pass a GGUF file with model weights.")
    if types <= {Q.F32, Q.F16, Q.BF16} and types != {Q.F32}:
        return torch.bfloat16 if Q.BF16 in types else torch.float16
    return torch.float32


def _convert_into(path: Path, dtype: torch.dtype, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # A weightless model on the meta device: transformers maps GGUF tensor names onto its names.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(
            str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # unsupported architecture or tokenizer, odd metadata: all about the file
        raise ModelLoadError(
            f"transformers cannot convert {path}: {e}. Pass a Hugging Face directory of the model instead.") from e
    # named_parameters() lists tied weights once, so a tied lm_head is not reported missing.
    missing = sorted(set(dict(skeleton.named_parameters())) - set(tensors))
    if missing:
        raise ModelLoadError(
            f"{path} lacks tensors the {config.model_type} model needs: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}. Pass a Hugging Face directory of the model instead.")

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    groups = _groups(path, config, skeleton)
    if groups:
        (out / QUANT_FILE).parent.mkdir()
        save_file(groups, str(out / QUANT_FILE), metadata={"format": "pt"})
    config.dtype = dtype  # the stored dtype, which the engine's dtype=auto reads
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)  # includes the GGUF's chat template, if it has one


def _groups(path: Path, config, skeleton) -> dict[str, torch.Tensor]:
    """The file's tensors in the types gguf_quant decodes (gguf_quant.Groups) as {hf name}.q4 (packed
    nibbles), .q5, .q6 or .q8, and .q{4,5,6,8}_scale, _min and _super where they have them, with the same names
    and row permutation transformers gives their dequantized copies."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from engine.loader import gguf_quant

    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if not gguf_quant.decodable(kind) or tensor.name not in names:
            continue
        groups = gguf_quant.decode(tensor.data, kind, tensor.data.shape[0]).map(lambda t: torch.from_numpy(
            np.ascontiguousarray(processor.process(weights=t.numpy(), name=tensor.name).weights)))
        hf, tag = names[tensor.name], f"q{groups.bits}"
        for suffix, t in zip(("", "_scale", "_min", "_super"), groups[1:]):
            if t is not None:
                out[f"{hf}.{tag}{suffix}"] = t
    return out


def gguf_groups(model_dir: Path):
    """A lookup `hf weight name -> gguf_quant.Groups` over a converted GGUF's own quantized tensors, or
    None when the directory has none."""
    file = Path(model_dir) / QUANT_FILE
    if not file.is_file():
        return None
    from engine.loader.gguf_quant import Groups
    from engine.loader.weights import SafetensorsFile

    reader = SafetensorsFile(file)

    def groups(name: str):
        for bits in (4, 5, 6, 8):
            names = [f"{name}.q{bits}{suffix}" for suffix in ("", "_scale", "_min", "_super")]
            if names[0] in reader.header:
                return Groups(bits, *(reader.get(n) if n in reader.header else None for n in names))
        return None

    return groups
