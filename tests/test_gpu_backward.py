"""The backward kernels against float64 reference gradients on the GPU.

Rule (flash-attn's): max|grad - ref64| <= 3 * max|grad_lowp - ref64| + floor, where
grad_lowp is plain attention's backward rounded to the input dtype at every
stage and floor is one ulp of the dtype at the gradient's scale (D = rowsum(dO O)
is taken from the rounded O, as in FlashAttention, which tiny shapes feel). Gradients
land in NaN-poisoned memory, so an element never written fails the NaN check.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _device, _plan, experiment
from cuflash.reference import (attention_lowp_backward, attention_lowp_varlen_backward, attention_reference_backward,
                               attention_reference_varlen_backward)

from .rule import check_gradient
from .strategies import Shape, attention_shapes, random_dout, random_qkv
from .test_gpu_forward import Launches, check_against_reference, cupy_dtype, poisoned_allocations

pytestmark = pytest.mark.gpu


def run_backward(shape: Shape, dtype: str, seed: int, deterministic: bool):
    import cupy
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(shape, cupy_dtype(dtype), rng, xp=cupy)
    dout = random_qkv(Shape(shape.batch, shape.seqlen_q, shape.seqlen_q, shape.nheads, shape.nheads,
                            shape.headdim, False), cupy_dtype(dtype), rng, xp=cupy)[0]
    out, lse = cuflash.attention(q, k, v, causal=shape.causal, return_lse=True)
    with poisoned_allocations(), Launches() as launches:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=shape.causal,
                                           deterministic=deterministic)
    return (dout, q, k, v), grads, launches


def check_gradients(dout, q, k, v, grads, causal, scale=None, dlse=None, varlen=None, window_size=(-1, -1)):
    """The rule, for dense arrays or packed ones (varlen = (cu_seqlens_q, cu_seqlens_k)),
    of the gradients of out (dout) and, given dlse, of lse too; NumPy or CuPy arrays."""
    options = dict(causal=causal, softmax_scale=scale, dlse=dlse, window_size=window_size)
    if varlen is None:
        refs = attention_reference_backward(dout, q, k, v, **options)
        lowps = attention_lowp_backward(dout, q, k, v, **options)
    else:
        refs = attention_reference_varlen_backward(dout, q, k, v, *varlen, **options)
        lowps = attention_lowp_varlen_backward(dout, q, k, v, *varlen, **options)
    for name, grad, ref, lowp, like in zip(("dq", "dk", "dv"), grads, refs, lowps, (q, k, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
        check_gradient(grad, ref, lowp, str(q.dtype), name)


shapes = attention_shapes(max_batch=3, max_seqlen=1024, max_headdim=256, max_nheads_kv=2, max_group=4)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, dtype=st.sampled_from(["float16", "bfloat16"]), deterministic=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_backward_matches_reference(shape: Shape, dtype, deterministic, seed):
    (dout, q, k, v), grads, launches = run_backward(shape, dtype, seed, deterministic)
    pointers = {p for call, _ in launches.calls for p in call}
    assert {x.data.ptr for x in (dout, q, k, v)} <= pointers  # read in place
    assert {g.data.ptr for g in grads if g.size} <= pointers  # written in place
    check_gradients(dout, q, k, v, grads, shape.causal)


@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 2048, 2048, 4, 1, 128, True), "bfloat16"),
    (Shape(1, 1999, 2047, 4, 2, 64, True), "float16"),
    (Shape(1, 2048, 129, 2, 1, 256, True), "bfloat16"),
    (Shape(2, 1, 1500, 4, 4, 59, False), "float16"),
    (Shape(1, 1025, 700, 6, 2, 200, False), "bfloat16"),
    (Shape(1, 640, 640, 2, 2, 224, True), "float16"),
    (Shape(1, 777, 1031, 2, 1, 160, True), "bfloat16"),
    (Shape(1, 513, 900, 4, 4, 96, False), "float16"),
    (Shape(1, 300, 1200, 2, 1, 32, True), "bfloat16"),
    (Shape(1, 700, 300, 2, 1, 192, True), "float16"),
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_long_sequences(shape, dtype, deterministic):
    (dout, q, k, v), grads, _ = run_backward(shape, dtype, shape.seqlen_k, deterministic)
    check_gradients(dout, q, k, v, grads, shape.causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_is_bitwise_stable_across_runs_and_streams(head_dim):
    import cupy
    shape = Shape(2, 777, 1029, 8, 2, head_dim, True)
    (dout, q, k, v), first, _ = run_backward(shape, "bfloat16", 7, deterministic=True)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for _ in range(3):
        with cupy.cuda.Stream():
            again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
            cupy.cuda.get_current_stream().synchronize()
        for a, b in zip(first, again):
            assert (a.view(cupy.uint16) == b.view(cupy.uint16)).all()


def launched_kinds(monkeypatch) -> list[str]:
    """The kinds of kernel the next backward launches (its launch plan is built afresh)."""
    kinds = []
    real = _plan.backward
    forget_warm_calls()
    monkeypatch.setattr(_plan, "backward", lambda *args: kinds.extend(s.kernel.kind for s in real(*args).steps)
                        or real(*args))
    return kinds


def forget_warm_calls() -> None:
    """The next calls plan and bind their launches afresh (entering and leaving an
    experiment.override forgets every plan, launcher and warm call)."""
    with experiment.override():
        pass


@pytest.mark.parametrize("head_dim,deterministic,softcap,one_pass", [
    (128, False, 0.0, True), (64, False, 0.0, True), (256, False, 0.0, True), (192, False, 0.0, True),
    (160, False, 0.0, True), (224, False, 0.0, True), (256, True, 0.0, False),
    (128, True, 0.0, False), (128, False, 5.0, True), (256, False, 5.0, True), (256, True, 5.0, False),
    (96, False, 0.0, True), (160, False, 5.0, True), (96, False, 5.0, True), (96, True, 5.0, False),
    (64, False, 5.0, True)])
def test_which_backward_runs(monkeypatch, head_dim, deterministic, softcap, one_pass):
    """The one-pass kernel (dQ by atomics) by default, at every head dim, extras too; the
    dK/dV + dQ passes when deterministic. On a Hopper GPU the sm_90a backward in their place
    from d 64 to 128, extras too, deterministic too (dQ added in a fixed order), and its wide
    kernel at d 161-192 and 225-256 without extras, not deterministic; for these dense calls
    at d 65-128, dQ's conversion beside the kernel's last CTAs where the device launches
    dependents."""
    import cupy
    q = cupy.ones((1, 70, 2, head_dim), dtype=cupy.float16)
    out, lse = cuflash.attention(q, q, q, softcap=softcap, return_lse=True)
    kinds = launched_kinds(monkeypatch)
    cuflash.attention_backward(q, q, q, q, out, lse, softcap=softcap, deterministic=deterministic)
    hopper = _device.facts(0).sm90a
    sm90 = hopper and 64 <= head_dim <= 128
    wide = hopper and _plan.head_dim_bucket(head_dim) in (192, 256) and softcap == 0 and not deterministic
    kernel = "backward_sm90" if sm90 else "backward_sm90_wide" if wide else "backward"
    beside = sm90 and head_dim > 64 and _device.facts(0).dependent_launches  # (dense, 64 rows: beside)
    expected = (["backward_preprocess", kernel, "backward_convert_dq_by_head" if beside else "backward_convert_dq"]
                if one_pass or sm90 else ["backward_preprocess", "backward_dq", "backward_dkdv"])
    assert kinds == expected


@pytest.mark.parametrize("arch", ["sm_80", "sm_86"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_the_tiles_of_smaller_devices(monkeypatch, arch, head_dim):
    """The tiles another arch's shared memory picks (one stage, smaller tiles, or the
    two-kernel backward where the one-pass kernel does not fit) run correctly here."""
    shape = Shape(2, 333, 301, 4, 2, head_dim, True)
    with experiment.override(shared_limit=_plan.shared_memory_limit(arch)):
        (dout, q, k, v), grads, _ = run_backward(shape, "bfloat16", head_dim, deterministic=False)
    check_gradients(dout, q, k, v, grads, shape.causal)


def test_fully_masked_rows_have_zero_gradients():
    import cupy
    # causal with seqlen_q > seqlen_k: queries 0..99 see no key.
    shape = Shape(1, 164, 64, 4, 2, 128, True)
    for deterministic in (False, True):
        (dout, q, k, v), (dq, dk, dv), _ = run_backward(shape, "float16", 3, deterministic)
        assert not any(cupy.isnan(g).any() for g in (dq, dk, dv))
        assert (dq[:, :100] == 0).all()
        check_gradients(dout, q, k, v, (dq, dk, dv), causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [59, 64, 128, 200, 256])
@pytest.mark.parametrize("aligned", [False, True])
def test_strided_and_unaligned_views(dtype, head_dim, aligned):
    """dout and out as (b, h, s, d) storage viewed as (b, s, h, d), or as column windows
    of a wider array whose rows are not 16-byte aligned: the preprocess reads D = rowsum(dO
    O) from the strides as they are, with 16-byte loads only where every row allows them."""
    import cupy
    rng = np.random.default_rng(head_dim)
    shape = Shape(2, 301, 257, 4, 2, head_dim, True)
    q, k, v = random_qkv(shape, cupy_dtype(dtype), rng, xp=cupy)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)

    def relaid(x):
        if aligned:  # a transposed storage: other row and head strides, rows still aligned
            return cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        wide = cupy.empty(x.shape[:-1] + (x.shape[-1] + 3,), dtype=x.dtype)
        wide[..., 1:x.shape[-1] + 1] = x
        return wide[..., 1:x.shape[-1] + 1]
    dout = relaid(random_dout(shape, cupy_dtype(dtype), rng, xp=cupy))
    out_view = relaid(out)
    assert not dout.flags.c_contiguous and not out_view.flags.c_contiguous
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out_view, lse, causal=True)
    check_gradients(dout, q, k, v, grads, causal=True)


@pytest.mark.parametrize("group", [None, 1, 3, 7])
def test_tile_major_groups(group):
    """Causal grids run tile-major within groups of (head, batch) pairs (GridTile in
    common.cuh, _plan.tile_group): every CTA must still run once, the last group
    partial. None: the device's own group size, with more pairs (9 x 8) than a group
    holds on the H200 (33 backward, 66 forward)."""
    import cupy
    if group is not None:
        shape = Shape(5, 200 + group, 190, 4, 2, 64, True)  # 20 pairs forward, 10 backward
    else:
        shape = Shape(9, 130, 150, 8, 8, 128, True)
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(shape, cupy_dtype("bfloat16"), rng, xp=cupy)
    dout = random_dout(shape, cupy_dtype("bfloat16"), rng, xp=cupy)
    groups = None if group is None else lambda kernel, pairs, device: min(group, pairs)
    with poisoned_allocations(), experiment.override(tile_group=groups):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    check_against_reference(q, k, v, out, lse, causal=True)
    check_gradients(dout, q, k, v, grads, causal=True)


def test_empty_sequences():
    import cupy
    q = cupy.ones((1, 5, 2, 64), dtype=cupy.float16)
    empty = cupy.empty((1, 0, 2, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, empty, empty, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(q, q, empty, empty, out, lse)
    assert (dq == 0).all() and dk.shape == dv.shape == (1, 0, 2, 64)
    out, lse = cuflash.attention(empty, q, q, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(empty, empty, q, q, out, lse)
    assert dq.shape == (1, 0, 2, 64) and (dk == 0).all() and (dv == 0).all()


def test_backward_input_errors():
    import cupy
    q = cupy.ones((1, 8, 2, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 8\)"):
        cuflash.attention_backward(q, q, q, q, out, lse[:, :1])
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        cuflash.attention_backward(q, q, q, q, out, lse.astype(cupy.float16))
    with pytest.raises(ValueError, match=r"dout must have shape"):
        cuflash.attention_backward(q[:, :4], q, q, q, out, lse)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_backward(q, q, q, q, out, lse, deterministic="yes")


# --- the gradient of the LSE ----------------------------------------------------------------


def lse_gradient(lse, seed, poison=float("nan")):
    """A standard normal float32 gradient laid out like lse, `poison` on the rows whose lse is
    +inf (rows that see no key: the backward must ignore theirs)."""
    import cupy
    dlse = cupy.random.default_rng(seed).standard_normal(lse.shape, dtype=cupy.float32)
    return cupy.where(cupy.isinf(lse), cupy.float32(poison), dlse)


@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 300, 170, 4, 2, 64, True), "bfloat16"),  # rows 0..129 see no key
    (Shape(1, 257, 513, 6, 2, 128, False), "float16"),
    (Shape(1, 190, 190, 2, 1, 59, True), "float16"),  # odd head dim: the preprocess's unvectorized path
    (Shape(1, 200, 150, 2, 2, 256, True), "bfloat16"),
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dlse_matches_reference(shape, dtype, deterministic):
    """D = rowsum(dO O) - dLSE: the gradients of out and lse together against the oracle's,
    NaN on the lse gradient of rows that see no key."""
    import cupy
    rng = np.random.default_rng(shape.seqlen_q)
    q, k, v = random_qkv(shape, cupy_dtype(dtype), rng, xp=cupy)
    dout = random_dout(shape, cupy_dtype(dtype), rng, xp=cupy)
    out, lse = cuflash.attention(q, k, v, causal=shape.causal, return_lse=True)
    dlse = lse_gradient(lse, seed=shape.headdim)
    with poisoned_allocations(), Launches() as launches:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=shape.causal, deterministic=deterministic,
                                           dlse=dlse)
    assert dlse.data.ptr in {p for call, _ in launches.calls for p in call}  # read in place
    for grad in grads:
        assert cupy.isfinite(grad).all()
    check_gradients(dout, q, k, v, grads, shape.causal, dlse=dlse)


def packed_inputs(shape, seed: int):
    """fp16 CuPy (dout, q, k, v) of a VarlenShape, and its packing (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    import cupy
    rng = np.random.default_rng(seed)
    q, k, v = (cupy.asarray(rng.standard_normal(s), dtype=cupy.float16) for s in (shape.q_shape, shape.kv_shape,
                                                                                  shape.kv_shape))
    dout = cupy.asarray(rng.standard_normal(shape.q_shape), dtype=cupy.float16)
    packing = (cupy.asarray(shape.cu_seqlens_q), cupy.asarray(shape.cu_seqlens_k), shape.max_seqlen_q,
               shape.max_seqlen_k)
    return (dout, q, k, v), packing


def test_dlse_varlen_matches_reference():
    """Packed sequences (one with no rows, one with no keys): dlse laid out (nheads, total_q)."""
    import cupy

    from .strategies import VarlenShape
    (dout, q, k, v), packing = packed_inputs(VarlenShape((100, 0, 257, 64), (130, 40, 0, 300), 4, 2, 128, True), 11)
    cu_q, cu_k = packing[:2]
    out, lse = cuflash.attention_varlen(q, k, v, *packing, causal=True, return_lse=True)
    dlse = lse_gradient(lse, seed=12)
    with poisoned_allocations():
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, causal=True, dlse=dlse)
    for grad in grads:
        assert cupy.isfinite(grad).all()
    check_gradients(dout, q, k, v, grads, True, dlse=dlse, varlen=(cu_q, cu_k))


def test_dlse_warm_calls_read_their_own():
    """A warm call's cached launch plan fills the dlse pointer each time (null without one):
    with, without, then with another dlse, each as computed afresh."""
    import cupy
    shape = Shape(2, 150, 100, 4, 2, 64, True)
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(shape, cupy_dtype("bfloat16"), rng, xp=cupy)
    dout = random_dout(shape, cupy_dtype("bfloat16"), rng, xp=cupy)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)

    def backward(dlse):
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dlse=dlse)

    first, second = lse_gradient(lse, 1), lse_gradient(lse, 2)
    runs = [backward(first), backward(None), backward(second), backward(first), backward(None)]
    for a, b in zip(runs[0], runs[3]):
        assert (a.view(cupy.uint16) == b.view(cupy.uint16)).all()
    for a, b in zip(runs[1], runs[4]):
        assert (a.view(cupy.uint16) == b.view(cupy.uint16)).all()
    for run, dlse in zip(runs[:3], (first, None, second)):
        check_gradients(dout, q, k, v, run, True, dlse=dlse)
    assert not (runs[0][0] == runs[2][0]).all() and not (runs[0][0] == runs[1][0]).all()


def test_dlse_errors():
    import cupy
    q = cupy.ones((1, 8, 2, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    with pytest.raises(TypeError, match="dlse must be the same kind of array on the same device as q"):
        cuflash.attention_backward(q, q, q, q, out, lse, dlse=lse.get())
    with pytest.raises(ValueError, match=r"dlse must have lse's shape \(1, 2, 8\)"):
        cuflash.attention_backward(q, q, q, q, out, lse, dlse=lse[:, :1])
    with pytest.raises(TypeError, match="dlse must have dtype float32"):
        cuflash.attention_backward(q, q, q, q, out, lse, dlse=lse.astype(cupy.float16))
    with pytest.raises(ValueError, match="dlse must be contiguous"):
        cuflash.attention_backward(q, q, q, q, out, lse, dlse=cupy.ones((1, 8, 2), cupy.float32).transpose(0, 2, 1))
