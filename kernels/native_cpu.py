"""Native C kernels for the CPU paths: compiled at first use with the machine's C compiler, loaded with ctypes.

Why: a few CPU steps are structurally slow in torch, whatever the formulation: a paged decode gathers
every request's KV blocks into a new tensor before it can multiply (a read, a write and a read again of
all the KV), a recurrent state update makes three passes over a state of megabytes, and a reduction as
small as one RMSNorm row costs tens of microseconds of dispatch. A plain C loop does each in one pass.

How: `kernels/native/<name>.c` (plain C11, no Python or torch headers, so it compiles in well under a
second; it may include the `.h` files of its folder, which are hashed with it) is compiled with `$CC` (default `cc`) and `-O3 -march=native -fopenmp-simd` into a shared library
under the cache directory (`$HYBRIDKV_CACHE_DIR`, else `$XDG_CACHE_HOME/hybridkv`, else
`~/.cache/hybridkv`), in `native/`. The file's name carries a hash of the source, the flags, the
compiler's version and the CPU's feature flags, so an edited source, another compiler or another CPU
compiles anew, and a library built for one CPU is never loaded on another. It is written under a
temporary name and renamed, so concurrent processes never load half a file.

Functions take raw pointers, element strides and sizes. Each is declared parameter by parameter in
native_args.py (a CPU tensor of the declared dtype, never a bare address) and called only through one
binding with keyword-only parameters that checks every tensor's dtype, shape and layout against the
others; the binding reaches it through a generated entry point taking one struct of its arguments
(C code compiled in the kernel file's unit: `library(name, extra=...)`), loaded with its `argtypes`
and `restype` (`function` below requires both). Each C function is tested against the torch path.

When it is not used:
- `HYBRIDKV_CPU_NATIVE=0` in the environment (read once, at import), or inside `forced_off()` (tests,
  comparisons): `library()` returns None and the torch path runs.
- No compiler, or a failed compile: `library()` logs one warning naming the command and returns None.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "HYBRIDKV_CPU_NATIVE"
SOURCE_DIR = Path(__file__).resolve().parent / "native"
FLAGS = ("-O3", "-std=c11", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
ARCH_FLAGS = ("-march=native",)
COMPILE_TIMEOUT_S = 120

_enabled = os.environ.get(ENV_VAR, "1").strip() != "0"
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether native kernels may be used (HYBRIDKV_CPU_NATIVE != 0 and not inside forced_off())."""
    return _enabled


@contextmanager
def forced_off():
    """Run the torch paths inside this block, as with HYBRIDKV_CPU_NATIVE=0."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def cache_dir() -> Path:
    """Where compiled libraries are kept (see the module docstring)."""
    if os.environ.get("HYBRIDKV_CACHE_DIR"):
        return Path(os.environ["HYBRIDKV_CACHE_DIR"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridkv" / "native"


def library(name: str, source_dir: Path | None = None, extra: str = "") -> ctypes.CDLL | None:
    """The loaded library built from `<source_dir>/<name>.c` (default kernels/native/), or None when
    native kernels are off or cannot be built here. Built at most once per process. extra: C code
    compiled after that file in the same unit (native_args.py's generated entry points; it is part
    of the library's hash)."""
    if not _enabled:
        return None
    src = (source_dir or SOURCE_DIR) / f"{name}.c"
    key = (name, str(src), extra)
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(name, src, extra)
    return _loaded[key]


def function(name: str, symbol: str, argtypes: list, restype, extra: str = ""):
    """`symbol` of library `name` (built with `extra`, see library()) with its ctypes signature
    set, or None. argtypes: one ctypes type per C parameter; restype: the C return type, None for
    void."""
    if not isinstance(argtypes, (list, tuple)) or not argtypes:
        raise TypeError(f"{name}.{symbol}: argtypes must list the C parameters' types, got {argtypes!r}")
    lib = library(name, extra=extra)
    if lib is None:
        return None
    fn = lib[symbol]  # its own function object: `lib.symbol` is shared, and anyone may reset its types
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def _identity(cc: str, flags: tuple[str, ...], source: bytes, headers: list[bytes]) -> str:
    """A hash of everything the built library depends on (the headers of its folder included)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    h = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), version.encode(), platform.machine().encode(),
                 _cpu_features().encode(), *headers):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_and_load(name: str, src: Path, extra: str = "") -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler (%s) found: the CPU paths use torch only (slower); set CC to one",
                       os.environ.get("CC", "cc"))
        return None
    try:
        source = src.read_bytes()
        headers = [h.read_bytes() for h in sorted(src.parent.glob("*.h"))]
    except OSError as e:
        logger.warning("native kernel source %s unreadable (%s): the torch path runs", src, e)
        return None
    errors = []
    for flags in (FLAGS + ARCH_FLAGS, FLAGS):  # a compiler without -march=native still gets a build
        out = cache_dir() / f"{name}-{_identity(cc, flags, source + extra.encode(), headers)}.so"
        if not out.exists():
            err = _compile(cc, flags, src, out, extra)
            if err is not None:
                errors.append(err)
                continue
        try:
            return ctypes.CDLL(str(out))
        except OSError as e:
            errors.append(f"loading {out}: {e}")
    logger.warning("native kernel %s not built, the torch path runs instead: %s", name, " | ".join(errors))
    return None


def _compile(cc: str, flags: tuple[str, ...], src: Path, out: Path, extra: str = "") -> str | None:
    """Compile src (followed by `extra`) into out (atomically); an error message, or None on success."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
        os.close(fd)
        unit = src
        if extra:  # one unit: the kernel file included, then the extra code (it sees the prototypes)
            unit = Path(tmp[:-len(".so")] + ".c")
            unit.write_text(f'#include "{src.name}"\n{extra}')
    except OSError as e:  # an unwritable cache: say where, and let the torch path run
        return f"cache directory {out.parent} unusable ({e}); set HYBRIDKV_CACHE_DIR to a writable one"
    cmd = [cc, *flags, "-I", str(src.parent), "-o", tmp, str(unit), "-lm"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if res.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {res.stderr.strip()[:500]}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"`{' '.join(cmd)}`: {e}"
    finally:
        for leftover in {tmp, str(unit)} - {str(src)}:
            if os.path.exists(leftover):
                os.unlink(leftover)
