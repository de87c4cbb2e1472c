"""The few CUDA driver calls a launch needs, through ctypes on libcuda.

Loading a cubin, asking a device's limits and launching a kernel need neither CuPy nor
a framework: a torch or JAX caller's first call would otherwise pay for importing CuPy
(about 100 ms). Kernels run in the device's primary context, the one the CUDA runtime
(and so CuPy, PyTorch and JAX) uses.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading

_p, _i, _u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint

# CUdevice_attribute and CUfunction_attribute values (cuda.h)
MULTIPROCESSOR_COUNT = 16
COMPUTE_CAPABILITY_MAJOR = 75
COMPUTE_CAPABILITY_MINOR = 76
MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # (clusters of more than 8 CTAs, up to 16 on Hopper)
# CUlaunchAttributeID and CUclusterSchedulingPolicy values (cuda.h)
_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
_CLUSTER_SCHEDULING_POLICY_SPREAD = 1
_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

_SIGNATURES = {
    "cuInit": (_u,),
    "cuDriverGetVersion": (ctypes.POINTER(_i),),
    "cuGetErrorName": (_i, ctypes.POINTER(ctypes.c_char_p)),
    "cuDeviceGet": (ctypes.POINTER(_i), _i),
    "cuDeviceGetName": (ctypes.c_char_p, _i, _i),
    "cuDeviceGetAttribute": (ctypes.POINTER(_i), _i, _i),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_p), _i),
    "cuCtxGetCurrent": (ctypes.POINTER(_p),),
    "cuCtxSetCurrent": (_p,),
    "cuCtxPushCurrent_v2": (_p,),
    "cuCtxPopCurrent_v2": (ctypes.POINTER(_p),),
    "cuModuleLoadData": (ctypes.POINTER(_p), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_p), _p, ctypes.c_char_p),
    "cuFuncSetAttribute": (_p, _i, _i),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (ctypes.POINTER(_i), _p, _i, ctypes.c_size_t),
    "cuOccupancyMaxActiveClusters": (ctypes.POINTER(_i), _p, _p),
    "cuMemsetD32Async": (ctypes.c_uint64, _u, ctypes.c_size_t, _p),
}  # (launcher() takes its own handles of cuLaunchKernel and cuCtxGetCurrent, without argtypes)


class CudaError(RuntimeError):
    pass


_loaded: list = []  # the library, once opened (errors are named through it)


@functools.cache
def _lib():
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise CudaError(f"the CUDA driver ({name}) cannot be loaded: {e}; cuflash's GPU path needs an NVIDIA "
                        f"driver (NumPy arrays take the CPU path)") from None
    for fn, argtypes in _SIGNATURES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, _i
    _loaded.append(lib)
    _check(lib.cuInit(0), "cuInit")
    return lib


def _check(status: int, what: str) -> None:
    if status:
        name = ctypes.c_char_p()
        if _loaded:
            _loaded[0].cuGetErrorName(status, ctypes.byref(name))
        raise CudaError(f"{what} failed: {name.value.decode() if name.value else 'CUDA error'} ({status})")


def attribute(device: int, attr: int) -> int:
    value = _i()
    _check(_lib().cuDeviceGetAttribute(ctypes.byref(value), attr, _device(device)), "cuDeviceGetAttribute")
    return value.value


@functools.cache
def version() -> int:
    """The driver's CUDA version, 1000 * major + 10 * minor (12030: CUDA 12.3)."""
    value = _i()
    _check(_lib().cuDriverGetVersion(ctypes.byref(value)), "cuDriverGetVersion")
    return value.value


def name(device: int) -> str:
    buffer = ctypes.create_string_buffer(256)
    _check(_lib().cuDeviceGetName(buffer, len(buffer), _device(device)), "cuDeviceGetName")
    return buffer.value.decode()


@functools.cache
def _device(ordinal: int) -> int:
    device = _i()
    _check(_lib().cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    return device.value


_primary_lock = threading.Lock()
_primary: dict[int, int] = {}


def primary_context(device: int) -> int:
    """The device's primary context (retained once, for the life of the process)."""
    context = _primary.get(device)
    if context is None:
        with _primary_lock:
            handle = _p()
            _check(_lib().cuDevicePrimaryCtxRetain(ctypes.byref(handle), _device(device)), "cuDevicePrimaryCtxRetain")
            context = _primary.setdefault(device, handle.value)
    return context


class _Current:
    """Run in ``device``'s primary context: push it when another is current, make it
    current when none is (as cudaSetDevice would: autograd's device thread may not
    have made a CUDA call yet), else nothing."""
    __slots__ = ("context", "pushed")

    def __init__(self, device: int):
        self.context = primary_context(device)
        self.pushed = False

    def __enter__(self):
        lib, current = _lib(), _p()
        lib.cuCtxGetCurrent(ctypes.byref(current))
        if current.value != self.context:
            if current.value:
                _check(lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
                self.pushed = True
            else:
                _check(lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _lib().cuCtxPopCurrent_v2(ctypes.byref(_p()))


def in_context(device: int) -> _Current:
    return _Current(device)


def load_function(cubin: bytes, lowered_name: str, device: int, shared_bytes: int, clustered: bool = False) -> int:
    """Load ``cubin`` into the device's primary context (never unloaded: the kernels
    stay for the life of the process) and return the CUfunction of ``lowered_name``,
    allowed ``shared_bytes`` of dynamic shared memory and, ``clustered``, clusters larger
    than the portable 8 CTAs."""
    lib = _lib()
    with in_context(device):
        module, function = _p(), _p()
        _check(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        _check(lib.cuModuleGetFunction(ctypes.byref(function), module, lowered_name.encode()), "cuModuleGetFunction")
        _check(lib.cuFuncSetAttribute(function, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
               "cuFuncSetAttribute")
        if clustered:
            _check(lib.cuFuncSetAttribute(function, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "cuFuncSetAttribute")
    return function.value


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", _i), ("pad", ctypes.c_char * 4), ("value", _u * 16)]  # (the value: a 64-byte union)


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", _u * 3), ("block", _u * 3), ("shared", _u), ("stream", _p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("count", _u)]


class LaunchEx:
    """A kernel launched through cuLaunchKernelEx, for what a plain launch cannot ask: thread
    block clusters of ``cluster`` CTAs along x, spread over the multiprocessors of a GPC
    (a cluster size the kernel was not compiled with), and, ``dependent``, a programmatic
    dependent launch (sm_90: the kernel may start as the one before it on the stream ends,
    and waits for its results in griddepcontrol.wait). Built once; ``launch(stream,
    arguments)`` launches it (the driver copies the configuration, so one serves every call)."""

    def __init__(self, function: int, grid: tuple[int, int, int], threads: int, shared: int, cluster: int = 1,
                 dependent: bool = False):
        self.function = _p(function)
        self.attributes = (_LaunchAttribute * 3)()
        count = 0
        if cluster > 1:
            self.attributes[0].id = _LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            self.attributes[0].value[:3] = (cluster, 1, 1)
            self.attributes[1].id = _LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
            self.attributes[1].value[0] = _CLUSTER_SCHEDULING_POLICY_SPREAD
            count = 2
        if dependent:
            self.attributes[count].id = _LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            self.attributes[count].value[0] = 1
            count += 1
        self.config = _LaunchConfig((_u * 3)(*grid), (_u * 3)(threads, 1, 1), shared, None, self.attributes, count)
        self._config = ctypes.byref(self.config)
        self._launch = _lib()["cuLaunchKernelEx"]
        self._launch.restype = _i

    def launch(self, stream: int, arguments: ctypes.Array) -> None:
        """``arguments``: the kernel's argument pointers (kernelParams)."""
        self.config.stream = stream
        status = self._launch(self._config, self.function, arguments, None)
        if status:
            _check(status, "cuLaunchKernelEx")

    def resident_clusters(self) -> int:
        """Clusters of this launch the GPU holds at once (its GPCs' multiprocessors, their
        shared memory, registers and threads)."""
        count = _i()
        _check(_lib().cuOccupancyMaxActiveClusters(ctypes.byref(count), self.function, ctypes.byref(self.config)),
               "cuOccupancyMaxActiveClusters")
        return count.value


def resident_blocks(function: int, threads: int, shared_bytes: int) -> int:
    """Blocks of ``function`` one multiprocessor holds at once (registers, shared memory, threads)."""
    blocks = _i()
    _check(_lib().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), function, threads, shared_bytes),
           "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return blocks.value


def zero_words(pointer: int, count: int, stream: int) -> None:
    """Sets ``count`` 4-byte words from ``pointer`` to 0, in order on ``stream`` (in the
    current context)."""
    _check(_lib().cuMemsetD32Async(pointer, 0, count, stream), "cuMemsetD32Async")


@functools.cache
def launcher():
    """launch(function, grid x/y/z, block x/y/z, shared bytes, stream, kernelParams, 0)
    and current_context(): the two calls of every launch; both raise on a CUDA error.
    Where CuPy is loaded (the caller passes CuPy arrays), its compiled driver bindings,
    a microsecond faster a launch; otherwise ctypes, since CuPy's bindings import CuPy
    whole on their first call (over 100 ms of a torch or JAX caller's first call)."""
    if "cupy" in sys.modules:
        from cupy_backends.cuda.api import driver
        return driver.launchKernel, driver.ctxGetCurrent
    lib = _lib()
    # Fresh function objects without argtypes: ints go as C ints and pointers as
    # c_void_p, with none of argtypes' per-argument conversions.
    raw_launch, raw_current = lib["cuLaunchKernel"], lib["cuCtxGetCurrent"]
    raw_launch.restype = raw_current.restype = _i

    def launch(function, x, y, z, bx, by, bz, shared, stream, arguments, extra):
        status = raw_launch(_p(function), x, y, z, bx, by, bz, shared, _p(stream), _p(arguments), None)
        if status:
            _check(status, "cuLaunchKernel")

    def current_context():
        context = _p()  # (one per call: ctypes lets go of the GIL during the call)
        raw_current(ctypes.byref(context))
        return context.value or 0

    return launch, current_context
