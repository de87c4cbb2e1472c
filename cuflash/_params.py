"""The kernels' one argument as ctypes structures with the same fields in the same order
as their CUDA structs: ``Params`` (cuda/params.cuh), ``DecodeParams`` and ``MergeParams``
(cuda/decode/decode_params.cuh), ``ModParams`` (cuda/mods.cuh), ``Sm90Params`` and
``Sm90ModParams`` (cuda/sm90/fwd_params.cuh), ``Sm90BackwardParams`` and
``Sm90BackwardModParams`` (cuda/sm90/bwd_params.cuh). The C ABI lays both sides out alike
(tests/test_compile.py checks every offset against NVRTC's own)."""
from __future__ import annotations

import ctypes

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class ArrayView(ctypes.Structure):
    _fields_ = [("ptr", _ptr), ("batch_stride", _i64), ("row_stride", _i64), ("head_stride", _i64)]


class _Struct(ctypes.Structure):
    def pointers(self) -> list[int]:
        """Every array this call touches, in field order (for zero-copy checks)."""
        found = []
        for name, kind in self._fields_:
            value = getattr(self, name)
            if kind is ArrayView:
                value = value.ptr
            elif issubclass(kind, _Struct):
                found += value.pointers()
                continue
            elif kind is not _ptr:
                continue
            if value:
                found.append(value)
        return found


class Params(_Struct):
    _fields_ = [
        ("q", ArrayView), ("k", ArrayView), ("v", ArrayView), ("o", ArrayView),
        ("dout", ArrayView), ("dq", ArrayView), ("dk", ArrayView), ("dv", ArrayView),
        ("lse", _ptr), ("dlse", _ptr), ("delta", _ptr), ("dq_accum", _ptr), ("dq_semaphore", _ptr),
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


MAX_MOD_TENSORS, MAX_MOD_DIMS = 8, 4  # (cuda/mods.cuh: kMaxModTensors, kMaxModDims)


class ModTensor(ctypes.Structure):
    """``cuflash::ModTensor``: a mod tensor's data, strides (elements) and sizes."""
    _fields_ = [("ptr", _ptr), ("stride", _i64 * MAX_MOD_DIMS), ("size", ctypes.c_int * MAX_MOD_DIMS)]


class BlockMaskView(ctypes.Structure):
    """``cuflash::BlockMaskView``: a block mask's int8 statuses (batch or 1, heads or 1,
    query blocks, key blocks) and their strides in elements (0 where broadcast); null
    without one."""
    _fields_ = [("status", _ptr), ("batch_stride", _i64), ("head_stride", _i64), ("row_stride", _i64)]


class ModParams(Params):
    """``cuflash::ModParams``: Params, then the mod tensors of a call with score_mod or
    mask_mod and its block mask (ctypes lays a subclass's fields after its base's, as C++
    does a POD base)."""
    _fields_ = [("tensors", ModTensor * MAX_MOD_TENSORS), ("blocks", BlockMaskView)]


class TensorMap(ctypes.Structure):
    """``cuflash::sm90::TensorMap``: the driver's opaque 128-byte CUtensorMap
    (cuflash/_tensormap.py builds it)."""
    _fields_ = [("v", ctypes.c_uint64 * 16)]


def _sm90_fields(params: type) -> list:
    """``cuflash::Sm90ParamsOf`` (cuda/sm90/fwd_params.cuh) over ``params``: the forward's
    Params (or ModParams), the batch, the scheduler's section, tile counter and tail cut (its
    first tile, its CTAs, the pieces' workspace), then the tensor maps of Q, K and V from the
    next 64-byte boundary (the CUDA struct aligns them to 64)."""
    return [("p", params), ("batch", ctypes.c_int), ("section", ctypes.c_int), ("tile_counter", _ptr),
            ("tail_start", ctypes.c_int), ("tail_ctas", ctypes.c_int), ("tail_key_tiles", ctypes.c_int),
            ("partial_o", _ptr), ("partial_lse", _ptr), ("arrivals", _ptr),
            ("_align", ctypes.c_uint8 * (-(ctypes.sizeof(params) + 56) % 64)),
            ("q", TensorMap), ("k", TensorMap), ("v", TensorMap)]


class Sm90Params(_Struct):
    """``cuflash::Sm90Params``: the sm_90a forward's argument (_sm90_fields)."""
    _fields_ = _sm90_fields(Params)


class Sm90ModParams(_Struct):
    """``cuflash::Sm90ModParams``: the same with the mods' ModParams."""
    _fields_ = _sm90_fields(ModParams)


def _sm90_backward_fields(params: type) -> list:
    """``cuflash::Sm90BackwardParamsOf`` (cuda/sm90/bwd_params.cuh) over ``params``: the
    backward's Params (or ModParams), the batch, the columns of dQ's accumulator, whether
    each CTA counts its end for the dQ conversion, then the tensor maps of Q, K, V and dO
    from the next 64-byte boundary."""
    return [("p", params), ("batch", ctypes.c_int), ("accum_cols", ctypes.c_int), ("count_done", ctypes.c_int),
            ("_align", ctypes.c_uint8 * (-(ctypes.sizeof(params) + 12) % 64)),
            ("q", TensorMap), ("k", TensorMap), ("v", TensorMap), ("dout", TensorMap)]


class Sm90BackwardParams(_Struct):
    """``cuflash::Sm90BackwardParams``: the sm_90a backward's argument (_sm90_backward_fields)."""
    _fields_ = _sm90_backward_fields(Params)


class Sm90BackwardModParams(_Struct):
    """``cuflash::Sm90BackwardModParams``: the same with the mods' ModParams."""
    _fields_ = _sm90_backward_fields(ModParams)


class MergeParams(_Struct):
    """``cuflash::MergeParams`` (cuda/decode/decode_params.cuh)."""
    _fields_ = [
        ("parts", _ptr), ("lses", _ptr), ("out", _ptr), ("out_lse", _ptr),
        ("part_stride", _i64), ("batch_stride", _i64), ("row_stride", _i64), ("head_stride", _i64),
        ("lse_part_stride", _i64), ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("out_batch_stride", _i64), ("out_row_stride", _i64), ("out_head_stride", _i64),
        ("count", ctypes.c_int), ("batch", ctypes.c_int), ("seqlen_q", ctypes.c_int), ("nheads", ctypes.c_int),
        ("headdim", ctypes.c_int),
    ]


class DecodeParams(_Struct):
    """``cuflash::DecodeParams`` (cuda/decode/decode_params.cuh)."""
    _fields_ = [
        ("q", ArrayView), ("o", ArrayView), ("k_cache", ArrayView), ("v_cache", ArrayView),
        ("k_new", ArrayView), ("v_new", ArrayView),
        ("lse", _ptr), ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("partial_o", _ptr), ("partial_lse", _ptr), ("query_rows", ctypes.c_int),
        ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr),
        ("cache_seqlens", _ptr), ("cache_batch_idx", _ptr), ("cache_leftpad", _ptr),
        ("block_table", _ptr), ("block_table_stride", _i64),
        ("rotary_cos", _ptr), ("rotary_sin", _ptr),
        ("alibi_slopes", _ptr), ("alibi_batch_stride", _i64),
        ("seqlen_cache_all", ctypes.c_int), ("caches", ctypes.c_int), ("page_size", ctypes.c_int),
        ("capacity", ctypes.c_int),
        ("seqlen_q", ctypes.c_int), ("seqlen_new", ctypes.c_int), ("nheads", ctypes.c_int),
        ("heads_per_kv", ctypes.c_int), ("headdim", ctypes.c_int),
        ("rotary_dim", ctypes.c_int), ("rotary_rows", ctypes.c_int), ("rotary_interleaved", ctypes.c_int),
        ("rotary_float32", ctypes.c_int),
        ("window_left", ctypes.c_int), ("window_right", ctypes.c_int),
        ("scale", ctypes.c_float), ("scale_log2", ctypes.c_float), ("softcap", ctypes.c_float),
        ("num_splits", ctypes.c_int), ("parts", ctypes.c_int), ("deterministic", ctypes.c_int),
        ("max_parts", ctypes.c_int), ("min_part_tiles", ctypes.c_int),
        ("merge", MergeParams),
    ]

