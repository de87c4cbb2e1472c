"""Tensor maps for the sm_90a kernels' TMA loads (cuda/sm90/tma.cuh), built by the
driver's ``cuTensorMapEncodeTiled`` through ctypes.

A map describes one array of (batch, seqlen, heads, headdim) 16-bit elements to the copy
engine as a 4-D tensor, innermost first (headdim, seqlen, heads, batch), and the box one
load brings: 64 columns (128 bytes, the width of the 128-byte swizzle the wgmma
descriptors expect) by ``rows`` rows of one head of one sequence. Rows past the array's
end arrive as zeros. The map holds the array's address, so it is made per array; 128
bytes, passed to the kernel by value.
"""
from __future__ import annotations

import ctypes
import functools

from . import _driver
from ._params import TensorMap

# CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
# CUtensorMapFloatOOBfill (cuda.h)
DATA_TYPES = {"float16": 6, "bfloat16": 9}
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-range elements read as zeros
BOX_COLUMNS = 64  # 128 bytes of 16-bit elements

_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64


@functools.cache
def encode_function():
    """The driver's ``cuTensorMapEncodeTiled``, typed once a process: every map is encoded
    through it (a stand-in for it sees each encode)."""
    encode = _driver._lib().cuTensorMapEncodeTiled
    encode.argtypes = (ctypes.POINTER(TensorMap), ctypes.c_int, _u32, ctypes.c_void_p, ctypes.POINTER(_u64),
                       ctypes.POINTER(_u64), ctypes.POINTER(_u32), ctypes.POINTER(_u32), ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int)
    encode.restype = ctypes.c_int
    return encode


@functools.lru_cache(maxsize=1024)
def encode(pointer: int, dtype: str, shape: tuple[int, int, int, int], strides: tuple[int, int, int, int],
           rows: int) -> TensorMap:
    """The map of the array at ``pointer`` of ``shape`` (batch, seqlen, heads, headdim) and
    element ``strides`` (the last 1), loaded in boxes of ``rows`` x 64 columns. The copy
    engine needs the pointer 16-byte aligned and every other stride a multiple of 16 bytes:
    the planner sends other arrays to the mma.sync kernels. A map is a function of these
    arguments alone, so maps are kept by them: a training loop's buffers come back at the
    same addresses, and a warm call then encodes nothing. (Read, never written.)"""
    batch, seqlen, heads, headdim = shape
    if strides[3] != 1:
        raise ValueError(f"a tensor map needs the head dim contiguous, got strides {strides}")
    item = 2
    dims = (_u64 * 4)(headdim, seqlen, heads, batch)
    byte_strides = (_u64 * 3)(strides[1] * item, strides[2] * item, strides[0] * item)
    box = (_u32 * 4)(BOX_COLUMNS, rows, 1, 1)
    steps = (_u32 * 4)(1, 1, 1, 1)
    result = TensorMap()
    status = encode_function()(ctypes.byref(result), DATA_TYPES[dtype], 4, ctypes.c_void_p(pointer), dims,
                               byte_strides, box, steps, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_128B,
                               OOB_FILL_ZEROS)
    _driver._check(status, "cuTensorMapEncodeTiled")
    return result
