"""Arrays in and out: NumPy, CuPy, PyTorch and JAX, with zero copies.

``inspect`` turns any supported array into an ``ArrayInfo`` (pointer, shape,
strides in elements, dtype name, device); ``Framework`` allocates results of the
caller's kind on the caller's device and names the stream to launch on. Kernels
read and write the caller's memory directly; nothing here copies data.
"""
from __future__ import annotations

import contextlib
import functools
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
        itemsize, memory = x.itemsize, x.data  # (x.device makes a Device object: 5 us)
        dtype = _DTYPE_NAMES.get(x.dtype) or _DTYPE_NAMES.setdefault(x.dtype, str(x.dtype))
        return ArrayInfo(x, "cupy", memory.ptr, x.shape, tuple([s // itemsize for s in x.strides]), dtype,
                         memory.device_id)
    if root == "torch":
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {x.device}; cuflash takes CUDA tensors "
                            f"(or NumPy arrays for the CPU path)")
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
        if like.framework == "torch":
            torch = _torch()
            self._torch_device = like.obj.device
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.compile's kernels call
            self.stream = raw(like.device) if raw else torch.cuda.current_stream(self._torch_device).cuda_stream
        else:
            cupy = _cupy()
            with self.device:
                self.stream = cupy.cuda.get_current_stream().ptr
            if like.framework == "jax":
                like.obj.block_until_ready()  # JAX works on its own stream: wait for the inputs

    @functools.cached_property
    def device(self):
        """A context that makes the arrays' device CuPy's current one (nothing to do when
        it is already: making a CuPy Device costs microseconds)."""
        cupy = _cupy()
        if cupy.cuda.runtime.getDevice() == self.like.device:
            return contextlib.nullcontext()
        return cupy.cuda.Device(self.like.device)

    def empty(self, shape: tuple[int, ...], dtype: str, *, zeros: bool = False) -> ArrayInfo:
        """An array of the caller's kind on the caller's device and stream (uninitialised,
        or zeroed on the stream with ``zeros``), described; ``.obj`` is the array."""
        shape = tuple(shape)
        if self.like.framework == "torch":
            torch = _torch()
            make = torch.zeros if zeros else torch.empty
            out = make(*shape, dtype=_torch_dtype(dtype), device=self._torch_device)  # (unpacked: 1 us faster)
            ptr = out.data_ptr()
        else:
            cupy = _cupy()
            with self.device:
                out = (cupy.zeros if zeros else cupy.empty)(shape, dtype=_cupy_dtype(dtype))
            ptr = out.data.ptr
        return ArrayInfo(out, self.like.framework, ptr, shape, contiguous_strides(shape), dtype, self.like.device)

    def finish(self, out):
        """Hand a result allocated by ``empty`` back as the caller's kind."""
        if self.like.framework != "jax":
            return out
        import cupy
        import jax
        with self.device:
            cupy.cuda.get_current_stream().synchronize()  # JAX reads it on its own stream
        return jax.dlpack.from_dlpack(out)


@functools.cache  # an import statement costs ~0.1 us a time on the call path
def _torch():
    import torch
    return torch


@functools.cache
def _cupy():
    import cupy
    return cupy


@functools.cache
def _torch_dtype(name: str):
    return getattr(_torch(), name)


@functools.cache
def _cupy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    import numpy
    return numpy.dtype(name)

