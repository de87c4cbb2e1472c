"""NVRTC -> cubin at first use, with a disk cache; GPU-less compile-all for CI.

The cache key covers every byte of every source in ``cuflash/cuda``, the NVRTC
options, the NVRTC version, the target arch and the template instance, so any
edit to any header recompiles. Nothing here needs a GPU except ``load_kernel``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
from pathlib import Path

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
    return {p.name: p.read_bytes() for p in sorted(CUDA_DIR.glob("*.cu*"))}


def cache_dir() -> Path:
    root = os.environ.get("CUFLASH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuflash"


@dataclasses.dataclass(frozen=True)
class Resources:
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


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered_name: str  # the mangled symbol of the template instance
    resources: Resources


_lock = threading.Lock()


def compile_kernel(source: str, instance: str, arch: str) -> Compiled:
    """Compile one template ``instance`` of the kernels in ``cuda/<source>`` for
    ``arch`` (e.g. "sm_90"), or take it from the disk cache."""
    options = (f"--gpu-architecture={arch}",) + OPTIONS
    key = hashlib.sha256()
    for name, text in _sources().items():
        key.update(name.encode() + b"\0" + text + b"\0")
    key.update(repr((source, instance, options, nvrtc_version())).encode())
    path = cache_dir() / key.hexdigest()
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        return Compiled(path.with_suffix(".cubin").read_bytes(), meta["lowered_name"], Resources(**meta["resources"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass

    start = time.perf_counter()
    compiled = _run_nvrtc(source, instance, options)
    log.info("cuflash: compiled %s for %s in %.1f s (%d registers, %d bytes spilled)", instance, arch,
             time.perf_counter() - start, compiled.resources.registers, compiled.resources.spill_stores)
    _write_atomic(path.with_suffix(".cubin"), compiled.cubin)
    _write_atomic(path.with_suffix(".json"), json.dumps(
        {"lowered_name": compiled.lowered_name, "resources": dataclasses.asdict(compiled.resources)}).encode())
    return compiled


def _run_nvrtc(source: str, instance: str, options: tuple[str, ...]) -> Compiled:
    nvrtc = _nvrtc()
    headers = {n: t for n, t in _sources().items() if n.endswith(".cuh")}
    prog = nvrtc.createProgram(_sources()[source].decode(), source, list(headers.values()),
                               [n.encode() for n in headers])
    try:
        nvrtc.addNameExpression(prog, instance)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed to compile {instance}:\n{nvrtc.getProgramLog(prog)}") from e
        text = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, instance)
        lowered = lowered.decode() if isinstance(lowered, bytes) else lowered
        # The log describes every function; keep the block of this instance.
        block = text[text.find(f"Function properties for {lowered}"):]
        return Compiled(_whole_elf(nvrtc.getCUBIN(prog)), lowered, Resources.from_log(block))
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


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop the computation
        log.debug("cuflash: cannot write the kernel cache %s: %s", path, e)


def device_arch(device_id: int) -> str:
    import cupy
    major, minor = cupy.cuda.Device(device_id).compute_capability
    return f"sm_{major}{minor}"


@functools.cache
def load_kernel(source: str, instance: str, device_id: int, shared_bytes: int) -> int:
    """The CUfunction handle of ``instance`` on ``device_id``, compiled on first
    use and allowed ``shared_bytes`` of dynamic shared memory."""
    import cupy
    from cupy_backends.cuda.api import driver
    with _lock, cupy.cuda.Device(device_id):
        compiled = compile_kernel(source, instance, device_arch(device_id))
        module = cupy.cuda.function.Module()
        module.load(compiled.cubin)
        function = module.get_function(compiled.lowered_name)
        driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
        _modules.append((module, function))  # CuPy unloads a module when it is collected
        return function.ptr


_modules: list = []
