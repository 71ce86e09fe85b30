"""GGUF file -> cached model directory (config.json, tokenizer files, model.safetensors) holding the
file's own quantized weights as they are stored (gguf_groups/groups.safetensors) and the rest as floats.

The tensors get transformers' names and row order (the pieces of its own GGUF reader rename them and
undo llama.cpp's Q/K row permutation), one tensor at a time. Q4_0/Q4_1/Q4_K, Q5_K, Q6_K and
Q8_0/Q5_0/Q5_1 tensors (engine/loader/gguf_quant.py) are kept only as they are: the engine serves them
directly on the CPU (--quantization auto), and iter_weights dequantizes them, bit for bit as GGUF does,
where a float copy is asked for (--dtype float32, the exact reference). Other types (norms, F16/F32,
Q2_K/Q3_K/IQ*) are dequantized into model.safetensors. A layer's experts, which the file stacks, are
written one tensor per expert (gguf_families.py, with what else each family's file means beyond what
transformers' reader gives). Later runs reuse the directory.
transformers and gguf are imported inside functions: importing them takes seconds, which commands that
never convert should not pay.
"""

from __future__ import annotations

import functools
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
from engine.loader import gguf_families
from engine.progress import progress

logger = logging.getLogger(__name__)

# In a folder of its own, so that the checkpoint's *.safetensors stay the float weights alone.
# Bumped when what a conversion writes changes: older cached directories are converted again.
_FORMAT = 9


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
        with _parse_once():
            dtype = _stored_dtype(path)
            gguf_families.check_served(path)
            logger.info("Converting %s to %s (once; later runs reuse it)", path, out)
            _convert_into(path, dtype, tmp)
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
    """Make every `gguf.GGUFReader(path)` in this block share one parsed reader per file, and every
    `gguf.get_tensor_name_map(arch, layers)` one map.

    transformers parses the whole header again for the config, the tensors and the tokenizer's
    config; with a 150k-token vocabulary each parse takes tens of seconds, most of a conversion. It also
    builds the tensor-name map again for each of the model's modules (hundreds; seconds in all). It
    looks both up at call time, so swapping the attributes is enough.
    """
    import gguf

    original, original_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, original_map


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(path.parent), path.name
    try:
        with gguf_families.readable():
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = gguf_families.settle(path, config)
        # A weightless model on the meta device: transformers maps GGUF tensor names onto its names.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        written = _write_tensors(path, config, skeleton, dtype, out)
    except OSError as e:    # the file's header and tensor table were read before (_stored_dtype): the writing side
        raise ModelLoadError(
            f"Cannot write the converted {path.name} under {out.parent} ({e}). It needs about the file's size for its "
            f"quantized tensors and 4 bytes a weight for the rest: free space there or set SPEC_CACHE_DIR to a "
            f"folder with room.") from e
    except Exception as e:  # unsupported architecture or tokenizer, odd metadata: all about the file
        raise ModelLoadError(
            f"Cannot convert {path}: {e}. Pass a Hugging Face directory of the model instead.") from e
    # named_parameters() lists tied weights once, so a tied lm_head is not reported missing.
    missing = sorted(gguf_families.checkpoint_names(skeleton) - written)
    if missing:
        raise ModelLoadError(
            f"{path} lacks tensors the {config.model_type} model needs: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}. Pass a Hugging Face directory of the model instead.")
    config.dtype = dtype  # the stored dtype, which the engine's dtype=auto reads
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)  # includes the GGUF's chat template, if it has one


def _write_tensors(path: Path, config, skeleton, dtype: torch.dtype, out: Path) -> set[str]:
    """Write the file's tensors under transformers' names and row order (as its load_gguf_checkpoint
    gives them), one tensor at a time: peak memory is one tensor, not the model.
    Those in the types gguf_quant decodes (gguf_quant.Groups) go as they are stored, and only so, to
    out/QUANT_FILE: {hf name}.q4 (packed nibbles), .q5, .q6 or .q8, and .q{4,5,6,8}_scale, _min and
    _super where they have them; iter_weights dequantizes them when a float copy is asked for (a float
    copy on disk took 4 bytes a weight: 7.1 GB for a 1.5B model). The rest goes to out/model.safetensors,
    dequantized to `dtype`. Stacked experts go one expert at a time (gguf_families.experts).
    Returns the names written."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from engine.loader import gguf_quant
    from engine.loader.gguf_quant import QUANT_FILE
    from engine.loader.safetensors_io import SafetensorsWriter

    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    fields = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=fields)
    names = get_gguf_hf_weights_map(skeleton, processor, model_type=arch)     # Mixtral's are "llama" names
    context = {"tensor_key_mapping": names, "parsed_parameters": {"config": fields, "tensors": {}}}
    # Room for every name: an expert's (model.layers.{i}.mlp.experts.{e}.gate_proj.weight) is a layer's plus this.
    longest = max(map(len, names.values()), default=0) + len(".experts.65535.gate_proj.weight.q8_super")
    count = sum(len(gguf_families.experts(t.name, t.data) or [t]) for t in reader.tensors)
    written = set()

    def add(hf: str, groups: gguf_quant.Groups) -> None:
        for suffix, t in zip(("", "_scale", "_min", "_super"), groups[1:]):
            if t is not None:
                stored.add(f"{hf}.q{groups.bits}{suffix}", t)
        written.add(hf)

    with SafetensorsWriter(out / "model.safetensors", count, longest) as floats, \
            SafetensorsWriter(out / QUANT_FILE, 4 * count, longest) as stored:
        for tensor in progress(reader.tensors, f"converting {path.name}"):
            kind, data = tensor.tensor_type.name, tensor.data
            if (experts := gguf_families.experts(tensor.name, data)) is not None:
                for hf, part in experts:                # [rows, bytes or columns] each
                    if gguf_quant.decodable(kind):
                        add(hf, gguf_quant.decode(part, kind, part.shape[0]))
                    else:
                        floats.add(hf, torch.from_numpy(_dequantize(part, tensor.tensor_type)).to(dtype))
                        written.add(hf)
                continue
            found = _row_order(processor, tensor.name, data.shape[0], context) \
                if gguf_quant.decodable(kind) and data.ndim == 2 else None
            if found is not None:
                gguf_name, order = found
                groups = gguf_quant.decode(data, kind, data.shape[0])
                add(names[gguf_name], groups if order is None else groups.map(lambda t: t[order]))
                continue
            result = processor.process(weights=_dequantize(data, tensor.tensor_type), name=tensor.name, **context)
            # GPT-OSS's sinks: a parameter without a suffix, which llama.cpp writes with ".weight".
            hf = names.get(result.name) or names.get(result.name.removesuffix(".weight"))
            if hf is not None:
                floats.add(hf, torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype))
                written.add(hf)
    return written


def _row_order(processor, name: str, rows: int, context: dict):
    """(GGUF name after processing, row permutation or None for the identity) when transformers' processor
    only reorders the tensor's rows (Llama's Q/K rows, or nothing), found by processing the row numbers;
    None when it does anything else (a transpose, a changed value, a name it drops), or fails on them:
    then only the dequantized tensor is right."""
    probe = np.arange(rows, dtype=np.float64)[:, None]
    try:
        result = processor.process(weights=probe, name=name, **context)
    except Exception:           # a processor that reshapes by the model's width: not a row order
        return None
    moved = np.asarray(result.weights)
    if result.name not in context["tensor_key_mapping"] or moved.shape != (rows, 1) \
            or not np.array_equal(np.sort(moved[:, 0]), probe[:, 0]):
        return None
    order = moved[:, 0].astype(np.int64)
    return result.name, None if np.array_equal(order, probe[:, 0]) else torch.from_numpy(order)


def _dequantize(data: np.ndarray, kind) -> np.ndarray:
    """gguf.dequantize of a tensor's data (of GGMLQuantizationType `kind`) into an array of its own (F32
    comes back as a view of the file), 64 MiB of output at a time: its temporaries are several times what
    it returns (whole, Qwen2.5-Coder-1.5B's 150k-row embedding took its conversion's peak from 3.3 to 4.1
    GiB)."""
    import gguf

    if data.ndim < 2:
        return np.array(gguf.dequantize(data, kind))
    first = gguf.dequantize(data[:1], kind)
    out = np.empty((data.shape[0], *first.shape[1:]), first.dtype)
    step = max(1, (64 << 20) // max(1, first.nbytes))
    for row in range(0, len(out), step):
        out[row:row + step] = gguf.dequantize(data[row:row + step], kind)
    return out
