"""Building the C kernels of this folder (cpu_attention.c, cpu_w4a8.c, cpu_elementwise.c, cpu_argmax.c, and
cpu_decoder.c with the three it calls) once per machine.

A source is compiled when first needed with the system's C compiler (the one torch.compile needs
too) for this CPU (-march=native, so each kernel picks its instructions from what the CPU has), into
~/.cache/spec/kernels (SPEC_KERNEL_CACHE overrides), keyed by the sources, the compiler and the CPU's
flags; it takes about a second, and later starts load the library. No torch headers: callers use
ctypes with the tensors' pointers. Where a library cannot be built (no compiler) `Kernel.library()`
returns None, logs why once, and callers use their own fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(sources: list[Path]) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(sources[0].parent.glob("*.h"))]
    key = hashlib.sha256("\n".join([*(s.read_text() for s in sources), *headers, version, " ".join(_FLAGS),
                                    _cpu_flags()]).encode())
    cache = Path(os.environ.get("SPEC_KERNEL_CACHE", Path.home() / ".cache" / "spec" / "kernels"))
    target = cache / f"{sources[0].stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built aside and renamed into place: processes starting together (tensor-parallel ranks)
        # never load a half-written library.
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run([compiler, *_FLAGS, *map(str, sources), "-o", str(built), "-lm"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
            os.replace(built, target)
    return ctypes.CDLL(str(target))


class Kernel:
    """One C source of this folder (with the `others` it calls, linked into the same library), built on
    first use; `declare(library)` sets its functions' types; `unavailable` is the warning logged (with
    the reason) when it cannot be built."""

    def __init__(self, source: str, declare: Callable[[ctypes.CDLL], None], unavailable: str,
                 others: tuple[str, ...] = ()):
        self._sources = [Path(__file__).with_name(name) for name in (source, *others)]
        self._declare = declare
        self._unavailable = unavailable
        self._lock = threading.Lock()
        self._library: Optional[ctypes.CDLL] = None
        self._failure: Optional[str] = None

    def library(self) -> Optional[ctypes.CDLL]:
        """The built kernel, or None (the reason is logged once and kept in `failure()`)."""
        if self._library is not None:   # called on every kernel call: no lock once built
            return self._library
        with self._lock:
            if self._library is None and self._failure is None:
                try:
                    library = _build(self._sources)
                    self._declare(library)
                    self._library = library
                except (OSError, RuntimeError, AttributeError) as e:
                    self._failure = str(e)
                    log.warning(self._unavailable, e)
            return self._library

    def failure(self) -> Optional[str]:
        return self._failure
