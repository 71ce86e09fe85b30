"""Building the C kernels of this folder (cpu_attention.c, cpu_w4a8.c, cpu_elementwise.c, cpu_argmax.c,
cpu_keyed_sample.c, and cpu_decoder.c with the three it calls) once per machine.

A source is compiled with the system's C compiler ($CC, which may name a wrapper such as "ccache gcc";
else cc or gcc) for this CPU, into ~/.cache/spec/kernels (SPEC_KERNEL_CACHE overrides), keyed by the
sources, the compiler and the CPU's flags; later starts load the library. Flags are chosen per machine:
-march=native on x86 (with 512-bit vectors preferred where AVX-512 is there to use), -mcpu=native on
Arm, OpenMP where the compiler has it (else the kernels run on one thread: their pragmas are ignored).
No torch headers: callers use ctypes with the tensors' pointers. `build_all()` builds every kernel at
start-up and says in one line what runs and what falls back and why; where a library cannot be built
`Kernel.library()` returns None, logs why once, and callers use their own fallback.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Optional

log = logging.getLogger(__name__)

# Every C kernel's module, with what it is called in the start-up line.
KERNELS = {"cpu_attention": "attention", "cpu_w4a8": "w4a8", "cpu_decoder": "fused decoder layer",
           "cpu_elementwise": "elementwise", "cpu_argmax": "argmax", "cpu_keyed_sample": "keyed sampler"}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):       # x86, Arm
                return line
    except OSError:
        pass
    return ""


class Toolchain(NamedTuple):
    command: list[str]          # the compiler, with a wrapper's words
    version: str                # its first --version line
    flags: list[str]

    @property
    def openmp(self) -> bool:
        return "-fopenmp" in self.flags

    def describe(self) -> str:
        return f"{self.version} ({platform.machine()}, {'OpenMP' if self.openmp else 'no OpenMP: one thread'})"


_TRIVIAL = "int f(void) { return 0; }\n"
_OPENMP_PROBE = "#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n"


def _compiles(command: list[str], flags: list[str], source: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(source)
        try:
            return subprocess.run([*command, *flags, str(src), "-o", str(Path(tmp) / "probe.so")],
                                  capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


@functools.lru_cache(maxsize=None)
def _toolchain(cc: Optional[str]) -> Toolchain:
    """The compiler ($CC as given, else cc or gcc) and the flags it takes for this machine, probed once
    per process (a probe compile is a tenth of a second); RuntimeError where there is none that works."""
    command = shlex.split(cc) if cc else [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not command:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC)")
    try:
        run = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"the C compiler {shlex.join(command)!r} does not run: {exc}") from None
    if run.returncode != 0:
        said = run.stderr.strip()[-200:]
        raise RuntimeError(f"the C compiler {shlex.join(command)!r} does not run (`--version` exited "
                           f"{run.returncode}{': ' + said if said else ''})")
    base = ["-O3", "-fno-math-errno", "-shared", "-fPIC"]
    arch = platform.machine().lower()
    wanted = [["-march=native"]] if arch in ("x86_64", "amd64", "i686") else [["-mcpu=native"], ["-march=native"]]
    tuning = next((f for f in wanted if _compiles(command, base + f, _TRIVIAL)), [])
    if "avx512f" in _cpu_flags().split() and _compiles(command, base + tuning + ["-mprefer-vector-width=512"], _TRIVIAL):
        tuning = tuning + ["-mprefer-vector-width=512"]
    openmp = ["-fopenmp"] if _compiles(command, base + ["-fopenmp"], _OPENMP_PROBE) else []
    return Toolchain(command, (run.stdout.splitlines() or ["?"])[0].strip(), base + tuning + openmp)


def toolchain() -> Toolchain:
    return _toolchain(os.environ.get("CC") or None)


def _build(sources: list[Path]) -> ctypes.CDLL:
    tools = toolchain()
    headers = [h.read_text() for h in sorted(sources[0].parent.glob("*.h"))]
    key = hashlib.sha256("\n".join([*(s.read_text() for s in sources), *headers, *tools.command, tools.version,
                                    " ".join(tools.flags), _cpu_flags()]).encode())
    cache = Path(os.environ.get("SPEC_KERNEL_CACHE", Path.home() / ".cache" / "spec" / "kernels"))
    target = cache / f"{sources[0].stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built aside and renamed into place: processes starting together (tensor-parallel ranks)
        # never load a half-written library.
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run([*tools.command, *tools.flags, *map(str, sources), "-o", str(built), "-lm"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{shlex.join(tools.command)} failed: {run.stderr.strip()[-500:]}")
            os.replace(built, target)
    return ctypes.CDLL(str(target))


def build_all(track: Callable[[Iterable], Iterable] = iter) -> str:
    """Builds (or loads from the cache) every C kernel, one compiler per core, the builds seen through
    `track` (a progress display) as they end; returns the one line saying which run, on what, and which
    fall back and why. A kernel's own warning names its fallback."""
    kernels = {name: importlib.import_module(f"spec_kernels.{module}")._kernel for module, name in KERNELS.items()}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for _ in track(as_completed([pool.submit(kernel.library) for kernel in kernels.values()])):
            pass
    built, failed = [], {}
    for name, kernel in kernels.items():
        if kernel.library() is not None:
            built.append(name + (f" [{kernel.detail()}]" if kernel.detail() else ""))
        else:
            failed.setdefault(kernel.failure(), []).append(name)
    try:
        on = toolchain().describe()
    except RuntimeError:
        on = "no compiler"
    line = f"CPU kernels built with {on}: {', '.join(built) or 'none'}"
    return line + "".join(f"; falling back (slower) for {', '.join(names)}: {why}" for why, names in failed.items())


class Kernel:
    """One C source of this folder (with the `others` it calls, linked into the same library), built on
    first use; `declare(library)` sets its functions' types; `unavailable` is the warning logged (with
    the reason) when it cannot be built; `detail(library)` says which code path it runs on this CPU."""

    def __init__(self, source: str, declare: Callable[[ctypes.CDLL], None], unavailable: str,
                 others: tuple[str, ...] = (), detail: Optional[Callable[[ctypes.CDLL], str]] = None):
        self._sources = [Path(__file__).with_name(name) for name in (source, *others)]
        self._declare = declare
        self._unavailable = unavailable
        self._detail = detail
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

    def detail(self) -> Optional[str]:
        library = self.library()
        return self._detail(library) if library is not None and self._detail else None
