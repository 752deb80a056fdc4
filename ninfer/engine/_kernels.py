"""ninfer's native kernels: building them from the package's own C++ sources, loading them.

The sources (ninfer/engine/csrc) are compiled by the system's C++ compiler into one
shared library of torch operators (namespace `ninfer`) and one class
(`torch.classes.ninfer.Layers`): the kernels three times, for plain x86-64, AVX2 and
AVX-512, each in its own namespace; `configure` picks one at start-up. `./dev.sh` builds
the library during set-up (`ninfer build-kernels`); a server that finds none built tries
once itself, and where no compiler is found, or it fails, the engine runs its pure-torch
path and says why on the console.

The library is kept under the package (csrc/build/, when writable, as in a checkout or
an image built as root) or else the cache directory, in a folder named by a digest of
the sources, the torch version, the compiler and the flags: a change to any of them
builds anew, and builds for other versions stay where they are (KEEP_BUILDS of them, the
most recently used: two installs sharing a cache, or a checkout moving between two
versions, do not rebuild in turn), each marked used whenever it is found.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import torch

__all__ = [
    "ISAS",
    "KernelBuild",
    "build_kernels",
    "find_built",
    "library_dir",
    "load_kernels",
    "loaded_library",
    "torch_isa",
]

SOURCE_DIR = Path(__file__).with_name("csrc")
LIBRARY = "libninfer_kernels.so"
# Instruction sets, least to most; each build's flags (the kernels compute the same numbers
# in each: csrc/simd.h).
ISAS = ("default", "avx2", "avx512")
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_ISA_FLAGS = {
    # -O2 on x86-64, where the plain build is only the fallback for a CPU without AVX2:
    # with no FMA instruction each lane's fma is a call, and -O3 unrolled the 16 calls a
    # vector operation everywhere (106 s to compile on 2 cores, of a 110 s build; 31 s at
    # -O2, its one-row step 1.4x slower). Elsewhere (aarch64) it is the build that runs.
    "default": ["-O2"] if _X86 else [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
# Builds kept in a folder of builds, the most recently used (a build is a few MB).
KEEP_BUILDS = 4
# -ffp-contract=off: the compiler never fuses a multiply and an add the code wrote apart
# (the numbers would then depend on the instruction set); never -ffast-math.
_COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]


@attrs.frozen
class KernelBuild:
    """A built library, or why there is none."""

    path: Path | None
    reason: str = ""
    seconds: float = 0.0


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp"))


def _torch_flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for inc in cpp_extension.include_paths():
        flags += ["-isystem", inc]
    return flags


def _digest(compiler: str) -> str:
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    for part in (torch.__version__, version.stdout, sys.version, platform.machine()):
        h.update(part.encode())
    h.update(repr((_COMMON_FLAGS, _ISA_FLAGS)).encode())
    return h.hexdigest()[:16]


def library_dir(cache: Path | None) -> list[Path]:
    """Where built libraries are kept, first choice first: under the package, else the
    cache directory's kernels/ (None: no cache known)."""
    dirs = [SOURCE_DIR / "build"]
    if cache is not None:
        dirs.append(cache / "kernels")
    return dirs


def find_built(cache: Path | None) -> Path | None:
    """The library built from these sources with this torch and compiler, if any."""
    compiler = _compiler()
    return _built(cache, _digest(compiler)) if compiler is not None else None


def _built(cache: Path | None, key: str) -> Path | None:
    for d in library_dir(cache):
        path = d / key / LIBRARY
        if path.is_file():
            with contextlib.suppress(OSError):  # marked used (a read-only place: not)
                os.utime(path.parent)
            return path
    return None


def build_kernels(cache: Path | None, *, progress: Callable[[str], None] = print) -> KernelBuild:
    """Build the library (unless built already): the kernel builds and the operators
    compiled side by side, then linked. Never raises for a failed build: the reason is
    returned (the compiler's last lines)."""
    started = time.perf_counter()
    compiler = _compiler()
    if compiler is None:
        return KernelBuild(None, "no C++ compiler found (set CXX, or install g++)")
    key = _digest(compiler)
    found = _built(cache, key)
    if found is not None:
        return KernelBuild(found)
    target_dir = None
    for d in library_dir(cache):
        try:
            (d / key).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d / key, os.W_OK):
            target_dir = d / key
            break
    if target_dir is None:
        return KernelBuild(None, "no writable directory for the kernels' library")
    progress(f"building ninfer's native kernels with {compiler} (once; about a minute)")
    isas = ISAS if _X86 else ("default",)
    with tempfile.TemporaryDirectory(prefix="ninfer-kernels-", dir=target_dir) as tmp:
        obj = str(Path(tmp) / "ops.o")
        ops = [compiler, *_COMMON_FLAGS, *_torch_flags(), "-c", str(SOURCE_DIR / "ops.cpp")]
        jobs: list[tuple[str, list[str]]] = [("ops", [*ops, "-o", obj])]
        objects = [obj]
        for isa in isas:
            obj = str(Path(tmp) / f"isa_{isa}.o")
            src = str(SOURCE_DIR / f"isa_{isa}.cpp")
            jobs.append((f"isa_{isa}", [compiler, *_COMMON_FLAGS, *_ISA_FLAGS[isa], "-c", src,
                                        "-o", obj]))  # fmt: skip
            objects.append(obj)
        # Longest first, so that the short ones fill in beside it: on the 2-core machine
        # (GCC 12) AVX-512 56 s, plain 31, the operators (torch's headers) 18, AVX2 18.
        order = ("isa_avx512", "isa_default", "ops", "isa_avx2")
        failure = _run_all(sorted(jobs, key=lambda job: order.index(job[0])))
        if failure:
            return KernelBuild(None, failure, time.perf_counter() - started)
        from torch.utils import cpp_extension

        lib_dirs = cpp_extension.library_paths()
        link = [compiler, "-shared", "-o", str(Path(tmp) / LIBRARY), *objects]
        for lib in lib_dirs:
            link += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
        link += ["-lc10", "-ltorch_cpu", "-ltorch", "-lpthread"]
        failure = _run_all([("link", link)])
        if failure:
            return KernelBuild(None, failure, time.perf_counter() - started)
        final: Path = target_dir / LIBRARY
        os.replace(Path(tmp) / LIBRARY, final)  # atomic: a concurrent build loads whole files
    _prune(target_dir.parent)
    seconds = time.perf_counter() - started
    progress(f"built {final} in {seconds:.0f} s")
    return KernelBuild(final, seconds=seconds)


def _prune(builds: Path) -> None:
    """All but the KEEP_BUILDS most recently used builds in `builds` removed (a process
    that loaded one keeps its copy)."""
    found = [d for d in builds.iterdir() if (d / LIBRARY).is_file()]
    found.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for old in found[KEEP_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


def _run_all(jobs: list[tuple[str, list[str]]]) -> str:
    """Run the commands, as many at a time as there are CPUs (at most one each), each
    free CPU taking the next command as soon as one ends (give the longest first); the
    first failure's name and last lines, or ''."""

    def run(job: tuple[str, list[str]]) -> str:
        name, cmd = job
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode == 0:
            return ""
        tail = "\n".join(done.stdout.strip().splitlines()[-12:])
        return f"compiling {name} failed (exit {done.returncode}):\n{tail}"

    width = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=width) as pool:
        # every result taken before looking for a failure: a `map` left at the first one
        # cancels, as it is closed, the commands no CPU had started yet
        failures = list(pool.map(run, jobs))
    return next((f for f in failures if f), "")


_loaded: dict[str, Path] = {}


def load_kernels(path: Path) -> None:
    """Load the library into this process's torch (once: torch keeps it loaded)."""
    if "path" in _loaded:
        if _loaded["path"] != path:
            raise RuntimeError(f"another kernels library is loaded ({_loaded['path']})")
        return
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    _loaded["path"] = path


def loaded_library() -> Path | None:
    """The library this process loaded, if any."""
    return _loaded.get("path")


def torch_isa() -> str:
    """The instruction set torch dispatches its own kernels to on this CPU (lowered by
    ATEN_CPU_CAPABILITY), as a kernels build's name."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability.startswith("avx512"):
        return "avx512"
    if capability.startswith("avx2"):
        return "avx2"
    return "default"
