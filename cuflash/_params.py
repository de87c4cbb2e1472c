"""The kernels' one argument, ``cuflash::Params`` (cuda/params.cuh), as a ctypes
structure with the same fields in the same order: the C ABI lays both out alike
(tests/test_compile.py checks every offset against NVRTC's own)."""
from __future__ import annotations

import ctypes

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class ArrayView(ctypes.Structure):
    _fields_ = [("ptr", _ptr), ("batch_stride", _i64), ("row_stride", _i64), ("head_stride", _i64)]


class Params(ctypes.Structure):
    _fields_ = [
        ("q", ArrayView), ("k", ArrayView), ("v", ArrayView), ("o", ArrayView),
        ("dout", ArrayView), ("dq", ArrayView), ("dk", ArrayView), ("dv", ArrayView),
        ("lse", _ptr), ("dlse", _ptr), ("delta", _ptr), ("dq_accum", _ptr),
        ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr),
        ("alibi_slopes", _ptr), ("alibi_batch_stride", _i64),
        ("seed", ctypes.c_uint64), ("rng_offset", ctypes.c_uint64),
        ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int),
        ("nheads", ctypes.c_int), ("heads_per_kv", ctypes.c_int), ("headdim", ctypes.c_int),
        ("window_left", ctypes.c_int), ("window_right", ctypes.c_int),
        ("scale", ctypes.c_float), ("scale_log2", ctypes.c_float), ("softcap", ctypes.c_float),
        ("dropout_threshold", ctypes.c_uint32), ("dropout_scale", ctypes.c_float),
        ("tile_group", ctypes.c_int),
    ]

    def pointers(self) -> list[int]:
        """Every array this call touches, in field order (for zero-copy checks)."""
        found = []
        for name, kind in self._fields_:
            value = getattr(self, name)
            ptr = value.ptr if kind is ArrayView else (value if kind is _ptr else None)
            if ptr:
                found.append(ptr)
        return found
