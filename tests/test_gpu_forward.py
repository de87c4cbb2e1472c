"""The forward kernel against the float64 oracle on the GPU (CuPy, PyTorch, JAX), on each
forward family the GPU has (the ``forward_family`` fixture: on a Hopper GPU the sm_90a
kernel and the mma.sync kernels).

Rule (flash-attn's, tests/rule.py): max|out - ref64| <= 2 * max|out_lowp - ref64| + floor,
where out_lowp is plain attention rounded to the input dtype at every stage and floor is
half an ulp at 1 of that dtype; LSE within 1e-3. Outputs land in freshly poisoned memory,
so an element the kernel never writes shows up as NaN.
"""
import contextlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash

from .rule import FLOOR, LSE_ATOL, check_attention, tile_marked
from .strategies import Launches, Shape, attention_shapes, random_qkv

__all__ = ["FLOOR", "LSE_ATOL"]  # (the other GPU suites take them from here too)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("forward_family")]


def cupy_dtype(name):
    import ml_dtypes
    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[name]


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside comes filled with all-ones bits (NaN in fp16,
    bf16 and fp32), so an output element the kernel never writes stays NaN."""
    import cupy
    pool = cupy.get_default_memory_pool()

    def malloc(nbytes):
        memory = pool.malloc(nbytes)
        cupy.cuda.runtime.memsetAsync(memory.ptr, 0xFF, nbytes, cupy.cuda.get_current_stream().ptr)
        return memory

    cupy.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def check_against_reference(q, k, v, out, lse, causal, scale=None):
    """The rule for out and lse, NaN/inf parity for both."""
    check_attention(q, k, v, out, lse, causal=causal, softmax_scale=scale)


def attend_and_check(q, k, v, causal, scale=None):
    """One forward, its outputs in poisoned memory, checked against the rule."""
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    check_against_reference(q, k, v, out, lse, causal, scale)


shapes = attention_shapes(max_batch=4, max_seqlen=2048, max_headdim=256, max_nheads_kv=2, max_group=4)


def _tile_counters() -> int:
    """Scratch beside the arrays of a causal launch on the sm_90a forward (on a Hopper GPU,
    head dims 64 to 256 whose rows the copy engine reads): its tile counter (fwd.cu,
    Sm90Tiles)."""
    from cuflash import _device
    return int(_device.facts(0).sm90a)


@settings(deadline=None, max_examples=150,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(shape=shapes, dtype=st.sampled_from(["float16", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_forward_matches_reference(shape: Shape, dtype, seed):
    import cupy
    q, k, v = random_qkv(shape, cupy_dtype(dtype), np.random.default_rng(seed), xp=cupy)
    lse_shape = (shape.batch, shape.nheads, shape.seqlen_q)
    with poisoned_allocations(), Launches() as launches:
        out, lse = cuflash.attention(q, k, v, causal=shape.causal, return_lse=True)
    assert type(out) is cupy.ndarray and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == lse_shape
    (pointers, _), = launches.calls
    assert pointers[:3] == [q.data.ptr, k.data.ptr, v.data.ptr]  # read in place
    # (then the sm_90a forward's workspace: its tile counter, or a cut tail's pieces and counters)
    assert pointers[3:5] == [out.data.ptr, lse.data.ptr] and len(pointers) <= 8
    check_against_reference(q, k, v, out, lse, shape.causal)


def random_inputs(shape: Shape, dtype: str):
    """Normal q, k, v, seeded by seqlen_q."""
    import cupy
    return random_qkv(shape, cupy_dtype(dtype), np.random.default_rng(shape.seqlen_q), xp=cupy)


def tile_marked_inputs(shape: Shape, dtype: str):
    """Inputs on which a lost key tile fails the rule (tests/rule.py, tile_marked: every
    visible key weighs the same and each run of keys marks its own feature), seeded by seqlen_k."""
    import cupy
    return tile_marked(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.headdim,
                       cupy_dtype(dtype), np.random.default_rng(shape.seqlen_k), xp=cupy)


# Hypothesis favours small sizes; these pin down long, ragged and lopsided ones, and where each key tile counts.
@pytest.mark.parametrize("inputs,shape,dtype", [
    (random_inputs, Shape(4, 2048, 2048, 4, 1, 128, True), "bfloat16"),
    (random_inputs, Shape(1, 2047, 1999, 6, 2, 64, True), "float16"),
    (random_inputs, Shape(2, 1, 2048, 8, 8, 256, False), "bfloat16"),
    (random_inputs, Shape(1, 2048, 1, 2, 1, 59, True), "float16"),
    (random_inputs, Shape(3, 1025, 2048, 4, 2, 200, True), "bfloat16"),
    (random_inputs, Shape(2, 1031, 1031, 2, 2, 111, False), "float16"),
    (random_inputs, Shape(1, 1500, 2048, 4, 4, 32, False), "bfloat16"),
    (random_inputs, Shape(1, 777, 1200, 4, 2, 160, True), "float16"),
    (random_inputs, Shape(1, 640, 513, 2, 1, 224, True), "bfloat16"),
    (random_inputs, Shape(1, 900, 900, 2, 1, 96, True), "bfloat16"),
    (tile_marked_inputs, Shape(1, 3, 131072, 4, 1, 64, False), "bfloat16"),
    (tile_marked_inputs, Shape(2, 200, 20000, 4, 2, 128, False), "float16"),
    (tile_marked_inputs, Shape(1, 2048, 2048, 2, 2, 256, True), "bfloat16"),
    (tile_marked_inputs, Shape(2, 700, 700, 4, 4, 96, True), "float16"),
    (tile_marked_inputs, Shape(3, 1, 200, 2, 1, 64, False), "bfloat16"),
    (tile_marked_inputs, Shape(1, 1000, 9000, 2, 1, 128, False), "bfloat16"),
], ids=lambda value: value.__name__ if callable(value) else None)
def test_pinned_shapes(inputs, shape, dtype):
    attend_and_check(*inputs(shape, dtype), shape.causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [59, 64, 111, 200, 256])
def test_strided_and_unaligned_views(dtype, head_dim):
    """Strides other than the last dim go to the kernel as they are; views whose
    rows are not 16-byte aligned take the element-wise load path."""
    import cupy
    rng = cupy.random.default_rng(head_dim)
    shape = (2, 300, 4, head_dim)
    # (b, h, s, d) storage viewed as (b, s, h, d), and a column window of a wider array.
    q = rng.standard_normal((2, 4, 300, head_dim), dtype=cupy.float32).astype(cupy_dtype(dtype)).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 257, 2, head_dim + 3), dtype=cupy.float32).astype(cupy_dtype(dtype))[..., 1:head_dim + 1]
    v = rng.standard_normal((2, 257, 2, head_dim), dtype=cupy.float32).astype(cupy_dtype(dtype))
    assert q.shape == shape and not q.flags.c_contiguous and not k.flags.c_contiguous
    with poisoned_allocations(), Launches() as launches:
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert launches.calls[0][0][:2] == [q.data.ptr, k.data.ptr]
    check_against_reference(q, k, v, out, lse, causal=True)


def test_warm_calls_tell_alignment_apart():
    """A warm call reuses the launch plan of its signature (shapes, strides, dtypes,
    options): views of one shape and strides, 16-byte aligned and not, must still
    get the vectorized and the element-wise kernel."""
    import cupy
    wide = cupy.random.default_rng(3).standard_normal((2, 200, 2, 72), dtype=cupy.float32).astype(cupy.float16)
    for offset in (0, 1, 8, 3):
        q = k = v = wide[..., offset:offset + 64]
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        check_against_reference(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("library", ["cupy", "torch"])
def test_warm_calls_are_checked_like_the_first(library):
    """A warm call (its signature's checks and launch remembered) describes no array: a
    value equal to a valid one but of another type must still be refused, a different
    layout or dtype must be planned anew, and each call writes its own output."""
    import cupy
    q = cupy.random.default_rng(5).standard_normal((1, 80, 2, 64), dtype=cupy.float32).astype(cupy.float16)
    if library == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
        q = torch.from_dlpack(q)
    def host(x):
        return cupy.asnumpy(cupy.asarray(x)).astype(np.float32)
    first, second = (cuflash.attention(q, q, q, causal=True) for _ in range(2))
    assert first is not second and type(second) is type(q)
    np.testing.assert_array_equal(host(first), host(second))
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.attention(q, q, q, causal=1)
    for _ in range(2):
        windowed = cuflash.attention(q, q, q, window_size=(7, 0))
    with pytest.raises(TypeError, match="window_size right must be an integer"):
        cuflash.attention(q, q, q, window_size=(7, 0.0))
    np.testing.assert_array_equal(host(cuflash.attention(q, q, q, window_size=[7, 0])), host(windowed))
    head = q[:, :, 1:]  # one head: the same dims as before but another layout
    for _ in range(2):
        out = cuflash.attention(head, head, head, causal=True)
    assert out.shape == head.shape
    np.testing.assert_allclose(host(out), host(first)[:, :, 1:], atol=2e-3)


def test_warm_calls_launch_on_the_current_stream():
    import cupy
    q = cupy.zeros((1, 16, 1, 64), cupy.float16)
    for _ in range(2):
        cuflash.attention(q, q, q)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, Launches() as launches:
        cuflash.attention(q, q, q)
    assert launches.calls[0][1] == stream.ptr
    stream.synchronize()


def test_warm_call_from_a_fresh_thread():
    """A thread that has made no CUDA call yet has no current context (autograd runs
    backwards on such a thread); a warm call there, whose plan and memory are cached,
    must still launch."""
    import threading
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    q = torch.randn(1, 100, 2, 64, device="cuda", dtype=torch.float16)
    want = cuflash.attention(q, q, q, causal=True)
    got, errors = [], []

    def run():
        try:
            got.append(cuflash.attention(q, q, q, causal=True))
            torch.cuda.synchronize()
        except Exception as e:  # re-raised below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_lse_not_asked_for_is_not_written(head_dim):
    """Without return_lse the launch gets no LSE buffer (the kernel skips its stores),
    O is bitwise the same, and warm calls that switch between the two agree."""
    import cupy
    q, k, v = random_qkv(Shape(2, 77, 130, 4, 2, head_dim, True), np.float16, np.random.default_rng(head_dim), xp=cupy)
    for _ in range(2):
        with Launches() as launches:
            out = cuflash.attention(q, k, v, causal=True)
        (pointers, _), = launches.calls
        assert pointers[:4] == [q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr]
        assert len(pointers) == 4 + _tile_counters()
        with poisoned_allocations():
            out_with, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        assert bool((out == out_with).all())
        check_against_reference(q, k, v, out_with, lse, causal=True)


@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0])
def test_softmax_scale(scale):
    import cupy
    q, k, v = random_qkv(Shape(2, 129, 65, 4, 2, 64, True), np.float16, np.random.default_rng(1), xp=cupy)
    attend_and_check(q, k, v, True, scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rising", [True, False])
def test_row_max_that_keeps_growing(dtype, head_dim, rising):
    """Scores on a ramp of 0..60 across the keys: the row max grows past the running one
    by more than the conditional rescale's slack (2^8) tile after tile, whichever end of
    the key range the kernel visits first."""
    import cupy
    rng = cupy.random.default_rng(head_dim)
    seqlen, scale = 1000, 1 / math.sqrt(head_dim)
    ramp = cupy.linspace(0, 60, seqlen, dtype=cupy.float32)
    if not rising:
        ramp = ramp[::-1]
    q = 0.1 * rng.standard_normal((2, 600, 2, head_dim), dtype=cupy.float32)
    k = 0.1 * rng.standard_normal((2, seqlen, 1, head_dim), dtype=cupy.float32)
    q[..., 0] = 4.0
    k[:, :, 0, 0] = ramp / (4.0 * scale)  # score of key j: about ramp[j]
    v = rng.standard_normal((2, seqlen, 1, head_dim), dtype=cupy.float32)
    q, k, v = (x.astype(cupy_dtype(dtype)) for x in (q, k, v))
    for causal in (False, True):
        attend_and_check(q, k, v, causal)


def test_fully_masked_rows_and_empty_sequences():
    import cupy
    # causal with seqlen_q > seqlen_k: the first 100 queries see no key.
    q, k, v = random_qkv(Shape(1, 164, 64, 2, 1, 128, True), np.float16, np.random.default_rng(2), xp=cupy)
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert not cupy.isnan(out).any()
    assert (out[:, :100] == 0).all() and cupy.isinf(lse[:, :, :100]).all() and (lse[:, :, :100] > 0).all()
    check_against_reference(q, k, v, out, lse, causal=True)
    # seqlen_k == 0: every row sees nothing; seqlen_q == 0: an empty result, no launch.
    empty_kv = cupy.empty((1, 0, 1, 128), dtype=cupy.float16)
    out, lse = cuflash.attention(q, empty_kv, empty_kv, return_lse=True)
    assert (out == 0).all() and cupy.isposinf(lse).all()
    with Launches() as launches:
        out, lse = cuflash.attention(q[:, :0], k, v, return_lse=True)
    assert out.shape == (1, 0, 2, 128) and lse.shape == (1, 2, 0) and not launches.calls


def test_nan_propagates_like_the_reference():
    import cupy
    q, k, v = random_qkv(Shape(1, 200, 3, 3, 1, 96, False), np.float16, np.random.default_rng(3), xp=cupy)
    q[0, 17, 1, 5] = np.nan
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert cupy.isnan(out[0, 17, 1]).all() and cupy.isnan(out).sum() == 96
    check_against_reference(q, k, v, out, lse, causal=False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_tensors_zero_copy_on_current_stream(dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cupy
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(2, s, h, 128, device="cuda", dtype=tdtype) for s, h in ((333, 8), (257, 2), (257, 2)))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # torch's caching allocator hands a freed block of the same size on the same
        # stream back first: fill the blocks out and lse will get with NaN.
        poison = [torch.full(shape, math.nan, dtype=t, device="cuda") for shape, t in ((q.shape, tdtype), ((2, 8, 333), torch.float32))]
        poisoned = [p.data_ptr() for p in poison]
        del poison
        with Launches() as launches:
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    stream.synchronize()
    assert [out.data_ptr(), lse.data_ptr()] == poisoned
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.device == q.device
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 333)
    (pointers, launch_stream), = launches.calls
    assert pointers[:5] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()]
    assert len(pointers) == 5 + _tile_counters()
    assert launch_stream == stream.cuda_stream
    as_cupy = [cupy.from_dlpack(t.detach()) for t in (q, k, v, out, lse)]
    check_against_reference(*as_cupy, causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_arrays_zero_copy(dtype):
    jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
    import cupy
    import jax.numpy as jnp
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(key[0], (2, 191, 4, 64), dtype=getattr(jnp, dtype))
    k = jax.random.normal(key[1], (2, 300, 2, 64), dtype=getattr(jnp, dtype))
    v = jax.random.normal(key[2], (2, 300, 2, 64), dtype=getattr(jnp, dtype))
    with Launches() as launches:
        out, lse = cuflash.attention(q, k, v, causal=False, return_lse=True)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    (pointers, _), = launches.calls
    assert pointers[:3] == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert pointers[3:] == [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()]
    as_cupy = [cupy.from_dlpack(x) for x in (q, k, v, out, lse)]
    check_against_reference(*as_cupy, causal=False)


def test_gpu_input_errors():
    import cupy
    x = cupy.zeros((1, 8, 2, 64), dtype=cupy.float32)
    with pytest.raises(TypeError, match="cast to float16 or bfloat16"):
        cuflash.attention(x, x, x)
    h = x.astype(cupy.float16)
    with pytest.raises(TypeError, match="same kind of array"):
        cuflash.attention(h, np.zeros((1, 8, 2, 64), np.float16), h)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        cuflash.attention(h[..., ::2], h[..., ::2], h[..., ::2])
    with pytest.raises(TypeError, match="one dtype"):
        cuflash.attention(h, h, h.astype(cupy_dtype("bfloat16")))
