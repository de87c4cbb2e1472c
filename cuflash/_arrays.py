"""Arrays in and out: NumPy, CuPy, PyTorch and JAX, with zero copies.

``inspect`` turns any supported array into an ``ArrayInfo`` (pointer, shape,
strides in elements, dtype name, device); ``Framework`` allocates results of the
caller's kind on the caller's device and names the stream to launch on. Kernels
read and write the caller's memory directly; nothing here copies data.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple


# NamedTuples, not frozen dataclasses: five are made per call, and a frozen dataclass's
# __init__ (object.__setattr__ per field) was the largest single cost of a small call.
class ArrayInfo(NamedTuple):
    obj: Any
    framework: str  # "numpy", "cupy", "torch" or "jax"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # "float16", "bfloat16", "float32", ...
    device: int | None  # CUDA ordinal; None on the CPU

    @property
    def where(self) -> str:
        """The device as messages name it (checks compare ``device``)."""
        return "cpu" if self.device is None else f"cuda:{self.device}"


_ROOT_MODULES: dict = {}  # type -> its top-level module's name


def _root_module(x) -> str:
    t = type(x)
    return _ROOT_MODULES.get(t) or _ROOT_MODULES.setdefault(t, t.__module__.split(".")[0])


def contiguous_strides(shape) -> tuple[int, ...]:
    return _contiguous_strides(tuple(shape))


@functools.lru_cache(maxsize=4096)  # the same few shapes, call after call
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_TORCH_DTYPE_NAMES: dict = {}  # torch.bfloat16 -> "bfloat16" (str() of a dtype is slow on the call path)
_DTYPE_NAMES: dict = {}  # NumPy / CuPy dtype -> its name


def inspect(x, name: str) -> ArrayInfo:
    """Describe ``x`` (argument ``name``) without touching its data."""
    root = _root_module(x)
    if root == "numpy":
        strides = tuple(s // x.itemsize for s in x.strides)
        return ArrayInfo(x, "numpy", 0, tuple(x.shape), strides, str(x.dtype), None)
    if root == "cupy":
        _LIBRARIES.setdefault(x.__class__, cupy_calls())
        itemsize, memory = x.itemsize, x.data  # (x.device makes a Device object: 5 us)
        dtype = _DTYPE_NAMES.get(x.dtype) or _DTYPE_NAMES.setdefault(x.dtype, str(x.dtype))
        return ArrayInfo(x, "cupy", memory.ptr, x.shape, tuple([s // itemsize for s in x.strides]), dtype,
                         memory.device_id)
    if root == "torch":
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {x.device}; cuflash takes CUDA tensors "
                            f"(or NumPy arrays for the CPU path)")
        _LIBRARIES.setdefault(x.__class__, _torch_calls())
        dtype = _TORCH_DTYPE_NAMES.get(x.dtype) or _TORCH_DTYPE_NAMES.setdefault(
            x.dtype, str(x.dtype).removeprefix("torch."))
        return ArrayInfo(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), dtype, x.get_device())
    if root in ("jax", "jaxlib"):
        devices = x.devices()
        device = next(iter(devices))
        if len(devices) != 1 or device.platform not in ("gpu", "cuda"):
            raise TypeError(f"{name} must be a JAX array on a single CUDA device, got one on {devices}")
        return ArrayInfo(x, "jax", x.unsafe_buffer_pointer(), tuple(x.shape), contiguous_strides(x.shape),
                         str(x.dtype), getattr(device, "local_hardware_id", device.id))
    raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch or JAX array, got {type(x).__qualname__}")


class Framework:
    """Allocation and stream of the caller's array library, for results of its kind."""

    def __init__(self, like: ArrayInfo):
        self.like = like
        self.calls = _torch_calls() if like.framework == "torch" else cupy_calls()  # (JAX: CuPy's, then DLPack)
        self.stream = self.calls.stream(like.device)
        if like.framework == "jax":
            like.obj.block_until_ready()  # JAX works on its own stream: wait for the inputs

    def empty(self, shape: tuple[int, ...], dtype: str, *, zeros: bool = False) -> ArrayInfo:
        """An array of the caller's kind on the caller's device and stream (uninitialised,
        or zeroed on the stream with ``zeros``), described; ``.obj`` is the array."""
        shape, calls = tuple(shape), self.calls
        out = calls.empty(shape, calls.dtype(dtype), self.like.device, zeros)
        return ArrayInfo(out, self.like.framework, calls.pointer(out), shape, contiguous_strides(shape), dtype,
                         self.like.device)

    def scratch(self, pieces: list) -> tuple[list[ArrayInfo | None], tuple]:
        """A call's scratch in one allocation: each of ``pieces`` ((shape, dtype) of 4-byte
        items, or None for one the call has not) as an array in one float32 buffer (None for
        None), at a multiple of 256 bytes (an allocation of its own had that alignment), and
        the layout ``allocate_scratch`` makes the same from: the buffer's shape and dtype
        and each piece's byte offset (None for None)."""
        places, end = [], 0  # (byte offset, shape, dtype) of each piece, or None
        for piece in pieces:
            if piece is None:
                places.append(None)
                continue
            shape, dtype = piece
            places.append((end, tuple(shape), dtype))
            end += -(-math.prod(shape) * _ITEM_BYTES[dtype] // 256) * 256
        buffer = self.empty((end // 4,), "float32")
        arrays = [None if place is None else buffer._replace(ptr=buffer.ptr + place[0], shape=place[1],
                                                             strides=contiguous_strides(place[1]), dtype=place[2])
                  for place in places]
        offsets = tuple(None if place is None else place[0] for place in places)
        return arrays, (buffer.shape, self.calls.dtype("float32"), offsets)

    def finish(self, out):
        """Hand a result allocated by ``empty`` back as the caller's kind."""
        if self.like.framework != "jax":
            return out
        import jax
        self.calls.synchronize(self.like.device)  # JAX reads it on its own stream
        return jax.dlpack.from_dlpack(out)


_ITEM_BYTES = {"float32": 4, "int32": 4}  # (the dtypes of scratch pieces)


def allocate_scratch(calls, device: int, layout: tuple) -> tuple:
    """A warm call's scratch laid out as ``Framework.scratch`` said, through its library's
    ``calls``: the buffer (held until the launch: freed memory would be handed to the next)
    and each piece's pointer (0 for one the call has not)."""
    shape, dtype, offsets = layout
    buffer = calls.empty(shape, dtype, device)
    base = calls.pointer(buffer)
    return buffer, [0 if offset is None else base + offset for offset in offsets]


# -- warm calls ------------------------------------------------------------------------------
# A call signature that passed the checks once launches what it launched, without
# describing its arrays again: its key holds each array's ``signature``, read in the
# fewest of its library's own calls (a warm call's host time is what decode and small
# calls pay for).

_LIBRARIES: dict = {}  # array type -> its library's calls (CuPy's ndarray, torch's Tensor), once inspected


def signature(x):
    """What decides a call's checks and plan about a CuPy array or torch tensor (device,
    shape, strides, dtype, 16-byte alignment), in its library's own terms; None for
    anything else and for a type ``inspect`` has not seen yet."""
    calls = _LIBRARIES.get(x.__class__)
    return None if calls is None else calls.signature(x)


def library(x):
    """The calls of x's library; x's type has a ``signature``."""
    return _LIBRARIES[x.__class__]


class _CuPyCalls:
    """CuPy's cheapest calls for what a launch needs (also JAX's allocations, handed over
    through DLPack)."""

    def __init__(self):
        import cupy
        self.cupy, self.current_device = cupy, cupy.cuda.runtime.getDevice
        self.current_stream = cupy.cuda.get_current_stream

    @staticmethod
    def signature(x) -> tuple:
        memory = x.data  # (x.device makes a Device object: 5 us)
        return memory.device_id, x.shape, x.strides, x.dtype, memory.ptr % 16 == 0

    @staticmethod
    def pointer(x) -> int:
        return x.data.ptr

    def stream(self, device: int) -> int:
        return self.current_stream(device).ptr

    def empty(self, shape: tuple, dtype, device: int, zeros: bool = False):
        make = self.cupy.zeros if zeros else self.cupy.empty
        if self.current_device() == device:  # (making a CuPy Device costs microseconds)
            return make(shape, dtype)
        with self.cupy.cuda.Device(device):
            return make(shape, dtype)

    def on(self, device: int):
        """A context that makes ``device`` CuPy's current one (nothing to do where it is)."""
        if self.current_device() == device:
            return contextlib.nullcontext()
        return self.cupy.cuda.Device(device)

    @staticmethod
    @functools.cache
    def dtype(name: str):
        if name == "bfloat16":
            import ml_dtypes
            return ml_dtypes.bfloat16
        import numpy
        return numpy.dtype(name)

    def synchronize(self, device: int) -> None:
        self.current_stream(device).synchronize()


class _TorchCalls:
    """torch's cheapest calls for what a launch needs."""

    def __init__(self):
        import torch
        self.torch = torch
        self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.compile's kernels call

    @staticmethod
    def signature(x) -> tuple:
        return x.device, x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0

    @staticmethod
    def pointer(x) -> int:
        return x.data_ptr()

    def stream(self, device: int) -> int:
        if self.raw_stream is not None:
            return self.raw_stream(device)
        return self.torch.cuda.current_stream(device).cuda_stream

    def empty(self, shape: tuple, dtype, device: int, zeros: bool = False):
        make = self.torch.zeros if zeros else self.torch.empty
        return make(*shape, dtype=dtype, device=self.device(device))  # (unpacked: 1 us faster)

    @functools.cache
    def dtype(self, name: str):
        return getattr(self.torch, name)

    @functools.cache
    def device(self, ordinal: int):
        return self.torch.device("cuda", ordinal)


@functools.cache  # (one of each per process)
def cupy_calls() -> _CuPyCalls:
    """CuPy's calls, which CuPy and JAX results are made through: the one place they are
    chosen, so a stand-in array library (tests/test_warm.py) takes their place here."""
    return _CuPyCalls()


@functools.cache
def _torch_calls() -> _TorchCalls:
    return _TorchCalls()
