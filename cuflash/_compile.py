"""NVRTC -> cubin at first use, with a disk cache; GPU-less compile-all for CI.

The cache key covers every byte of every source in ``cuflash/cuda``, the NVRTC
options, the NVRTC version, the target arch and the template instance, so any
edit to any header recompiles. Nothing here needs a GPU except ``load_kernel``.

An entry is ``<key>.cubin`` plus ``<key>.json`` (its key, the cubin's sha256, the
mangled name, ptxas's report). It is never trusted blindly: an entry that fails its
checks is reported once, removed and rebuilt. Writes are atomic, cubin first; a
``<key>.lock`` file makes processes that need the same entry at once compile it once.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # Windows: no flock; processes may then compile one variant twice
    fcntl = None

log = logging.getLogger("cuflash")

CUDA_DIR = Path(__file__).parent / "cuda"
OPTIONS = ("--std=c++17", "-Xptxas=-v")


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "cuflash needs CuPy and NVRTC to compile its kernels: "
            "pip install 'cuflash[cuda12]' (or [cuda13])") from e
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.cache
def _sources() -> dict[str, bytes]:
    """Every kernel source and header, by its path under ``cuda/`` (``fwd.cu``,
    ``decode/split_kv.cu``): the names they include each other by."""
    return {p.relative_to(CUDA_DIR).as_posix(): p.read_bytes() for p in sorted(CUDA_DIR.rglob("*.cu*"))}


def cache_dir() -> Path:
    root = os.environ.get("CUFLASH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuflash"


class Resources(NamedTuple):
    """What ptxas reported for one kernel."""
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int

    @classmethod
    def from_log(cls, text: str) -> "Resources":
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
        if not (regs and spill):
            raise RuntimeError(f"no ptxas resource report in the NVRTC log:\n{text}")
        return cls(int(regs[1]), int(spill[2]), int(spill[3]), int(spill[1]))


class Compiled(NamedTuple):
    cubin: bytes
    lowered_name: str  # the mangled symbol of the template instance
    resources: Resources
    nvrtc: tuple[int, ...] = ()  # the version of NVRTC that compiled it


CACHE_FORMAT = 3  # part of the key: entries of an older layout are never looked up
# Every file the cache writes: an entry's cubin and metadata, its lock, a write under way.
_CACHE_FILE = re.compile(r"[0-9a-f]{64}\.(cubin|json|lock)(\.[0-9a-f]{16}\.tmp)?")

_lock = threading.Lock()


def compile_kernel(source: str, instance: str, arch: str, *, refresh: bool = False, prelude: str = "") -> Compiled:
    """Compile one template ``instance`` of the kernels in ``cuda/<source>`` for
    ``arch`` (e.g. "sm_90"), or take it from the disk cache. ``prelude``: CUDA text
    compiled in front of the source (a call's score_mod and mask_mod,
    ``cuflash.mod.kernel_source``), part of the key.

    The key covers every source byte, the instance, the arch and NVRTC's options, not
    NVRTC's version: a cache hit would have to load NVRTC to learn it, a library whose
    loading costs more than the rest of a first call (and the cubin of another NVRTC
    runs all the same). Each entry records the version that compiled it; ``refresh``
    (``python -m cuflash compile``) compiles again the entries of another version."""
    options = (f"--gpu-architecture={arch}",) + OPTIONS
    key = hashlib.sha256()
    for name, text in _sources().items():
        key.update(name.encode() + b"\0" + text + b"\0")
    key.update(repr((CACHE_FORMAT, source, instance, options)).encode())
    if prelude:  # (only then: the keys of the kernels without one stay as they were)
        key.update(b"prelude\0" + prelude.encode())
    path = cache_dir() / key.hexdigest()
    # A process that needs the entry while another compiles it waits here, then loads it.
    with _entry_lock(path):
        try:
            compiled = load_entry(path)
        except BadEntry as e:
            warnings.warn(f"cuflash: {e}; removed it, compiling the kernel again", RuntimeWarning, stacklevel=2)
            _remove_entry(path)
            compiled = None
        if compiled is not None and refresh and compiled.nvrtc != nvrtc_version():
            compiled = None
        if compiled is None:
            start = time.perf_counter()
            with_prelude = (prelude,) if prelude else ()  # (the plain call as it always was)
            compiled = run_nvrtc(source, instance, options, *with_prelude)
            log.info("cuflash: compiled %s for %s in %.1f s (%d registers, %d bytes spilled)", instance, arch,
                     time.perf_counter() - start, compiled.resources.registers, compiled.resources.spill_stores)
            _write_entry(path, compiled, arch, instance)
    return compiled


class BadEntry(Exception):
    """A cache entry that must not be loaded; the message names the file and its fault."""


def load_entry(path: Path) -> Compiled | None:
    """The cache entry ``path`` (its files' path without the suffix), or None if there
    is none. Raises BadEntry if it is corrupt, truncated or another key's."""
    meta_path, cubin_path = path.with_suffix(".json"), path.with_suffix(".cubin")
    try:
        text = meta_path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        if cubin_path.exists():
            raise BadEntry(f"{cubin_path} has no metadata ({meta_path.name})") from None
        return None
    except OSError as e:
        raise BadEntry(f"cannot read {meta_path}: {e.strerror}") from None
    try:
        meta = json.loads(text)
        key, digest, lowered_name = meta["key"], meta["cubin_sha256"], meta["lowered_name"]
        resources = Resources(**meta["resources"])
        made_by = tuple(meta.get("nvrtc", ()))
    except KeyError as e:
        raise BadEntry(f"{meta_path} lacks the key {e}") from None
    except (ValueError, TypeError) as e:
        raise BadEntry(f"{meta_path} is not cuflash cache metadata ({e})") from None
    if key != path.name:
        raise BadEntry(f"{meta_path} is the metadata of another entry, {key}")
    try:
        cubin = cubin_path.read_bytes()
    except OSError as e:
        raise BadEntry(f"cannot read {cubin_path}: {e.strerror}") from None
    if hashlib.sha256(cubin).hexdigest() != digest:
        raise BadEntry(f"{cubin_path} does not match the sha256 in its metadata (truncated or corrupt)")
    return Compiled(cubin, lowered_name, resources, made_by)


def verify_entry(path: Path) -> str | None:
    """Check the cache entry ``path`` as a load would: None if it is sound, else what
    is wrong with it, after removing it."""
    with _entry_lock(path):
        try:
            load_entry(path)
        except BadEntry as e:
            _remove_entry(path)
            return str(e)
    return None


def cache_files() -> list[Path]:
    """Every file in the cache folder that the cache wrote (and nothing else there)."""
    try:
        return sorted(p for p in cache_dir().iterdir() if _CACHE_FILE.fullmatch(p.name))
    except OSError:  # no cache folder yet
        return []


def cache_entries() -> list[Path]:
    """Each entry of the cache, as its files' path without the suffix."""
    return sorted({p.with_suffix("") for p in cache_files() if p.suffix in (".cubin", ".json")})


def _write_entry(path: Path, compiled: Compiled, arch: str, instance: str) -> None:
    meta = {"key": path.name, "arch": arch, "instance": instance, "lowered_name": compiled.lowered_name,
            "resources": compiled.resources._asdict(), "nvrtc": list(compiled.nvrtc),
            "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest()}
    # The cubin first: whoever finds the metadata finds the whole cubin.
    if _write_atomic(path.with_suffix(".cubin"), compiled.cubin):
        _write_atomic(path.with_suffix(".json"), json.dumps(meta).encode())


def _remove_entry(path: Path) -> None:
    for suffix in (".json", ".cubin"):
        with contextlib.suppress(OSError):
            path.with_suffix(suffix).unlink()


@contextlib.contextmanager
def _entry_lock(path: Path):
    """Hold the entry's lock file for the block. Where there is no lock to take (no
    fcntl, a read-only folder, a file system without flock) go on unlocked: at worst
    two processes compile the same entry, and each write is atomic."""
    with contextlib.ExitStack() as release:
        if fcntl is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o666)
                release.callback(os.close, fd)  # closing the file releases the lock
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                log.debug("cuflash: cannot lock the kernel cache entry %s: %s", path, e)
        yield


def run_nvrtc(source: str, instance: str, options: tuple[str, ...], prelude: str = "") -> Compiled:
    """``instance`` of ``cuda/<source>`` (``prelude`` in front of it) compiled by NVRTC with
    ``options``, the cache not consulted: the one place NVRTC runs, so a stand-in for it
    (tests count or fake the compiles) sees every compile ``compile_kernel`` makes."""
    nvrtc = _nvrtc()
    headers = {n: t for n, t in _sources().items() if n.endswith(".cuh")}
    prog = nvrtc.createProgram(prelude + _sources()[source].decode(), source, list(headers.values()),
                               [n.encode() for n in headers])
    try:
        nvrtc.addNameExpression(prog, instance)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed to compile {instance}:\n{nvrtc.getProgramLog(prog)}") from e
        text = nvrtc.getProgramLog(prog)
        text = text.decode() if isinstance(text, bytes) else text
        serialised = [line for line in text.splitlines() if "C75" in line]
        if serialised:  # setmaxnreg ignored or wgmma serialised: a silent several-fold slowdown
            raise RuntimeError(f"ptxas warned of {instance}:\n" + "\n".join(serialised))
        lowered = nvrtc.getLoweredName(prog, instance)
        lowered = lowered.decode() if isinstance(lowered, bytes) else lowered
        # The log describes every function; keep the block of this instance.
        block = text[text.find(f"Function properties for {lowered}"):]
        return Compiled(_whole_elf(nvrtc.getCUBIN(prog)), lowered, Resources.from_log(block), nvrtc_version())
    finally:
        nvrtc.destroyProgram(prog)


def _whole_elf(cubin: bytes) -> bytes:
    """CuPy's getCUBIN drops the last byte (it strips a C string's NUL, but a cubin
    is not one), which cuts the ELF program headers short: the driver loads it, but
    nvdisasm refuses it. Pad back to the size the ELF header declares."""
    ph_offset, sh_offset = struct.unpack_from("<QQ", cubin, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
    return cubin + bytes(max(0, end - len(cubin)))


def _write_atomic(path: Path, data: bytes) -> bool:
    """Write ``path`` whole or not at all (a new file beside it, renamed over it); False
    if it cannot be written. No fsync: an entry torn by a power cut fails its hash
    check and is rebuilt."""
    import secrets  # (writes only: a process that loads its kernels from the cache never imports it)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Mode 0o666 less the umask, as any new file gets (mkstemp's 0o600 would shut
            # the other users of a shared cache out); O_BINARY keeps Windows from
            # translating newlines.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:  # Ctrl-C included: leave no partial file behind
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    except OSError as e:  # a read-only home must not stop the computation
        log.debug("cuflash: cannot write the kernel cache %s: %s", path, e)
        return False
    return True


def check_supported(name: str, major: int, minor: int) -> None:
    """Refuse a GPU the kernels cannot run on (mma.sync on bf16, cp.async: sm_80) in one
    line, before NVRTC and ptxas would refuse it in pages."""
    if (major, minor) < (8, 0):
        raise RuntimeError(f"cuflash's kernels need compute capability 8.0 or newer (A100, RTX 30xx, L4/L40, "
                           f"H100/H200, ...); this GPU, {name}, has {major}.{minor}")


def device_arch(device_id: int) -> str:
    from . import _device
    device = _device.facts(device_id)
    check_supported(device.name, *device.capability)
    return device.arch


@functools.cache
def load_kernel(kernel, device_id: int) -> int:
    """The CUfunction handle of ``kernel`` (a variant of cuflash._plan: its source, template
    instance, arch, threads and dynamic shared memory, its mods) on ``device_id``: compiled
    on first use (for its arch, or the device's own), allowed its dynamic shared memory (and,
    for a clustered kind, clusters of up to 16 CTAs)."""
    from . import _driver
    with _lock:
        compiled = compile_kernel(kernel.source, kernel.instance, kernel.arch or device_arch(device_id),
                                  prelude=getattr(kernel, "mods", ""))
        return _driver.load_function(compiled.cubin, compiled.lowered_name, device_id, kernel.shared_bytes,
                                     getattr(kernel, "clustered", False))


@functools.cache
def resident_ctas(kernel, device_id: int) -> int:
    """The CTAs of ``kernel`` one multiprocessor of ``device_id`` holds at once (at least 1:
    its registers, shared memory and threads decide, which only the compiled kernel knows),
    read once, for the plans that ask (``_plan.tile_group``)."""
    from . import _driver
    return max(1, _driver.resident_blocks(load_kernel(kernel, device_id), kernel.threads, kernel.shared_bytes))
