"""cuflash.jax: custom_vjp over buffer_callback, eagerly, under jax.jit and jax.vmap.

CPU arrays go through the same buffer_callback route into the NumPy path, so the CPU tests
check the glue (shapes, jit, grad, vmap, errors) wherever JAX is installed. The tests marked
gpu run the CUDA kernels on XLA's buffers and check them against the float64 oracle with
flash-attn's gradient rule: max|grad - ref64| <= 3 * max|grad_lowp - ref64| + floor.
"""
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax  # noqa: E402
from cuflash import _kernels  # noqa: E402
from cuflash.reference import attention_lowp, attention_reference, attention_reference_backward  # noqa: E402

from .strategies import Shape, assert_close  # noqa: E402

def make_inputs(shape: Shape, dtype, seed=0):
    """Fresh standard normal q, k, v and dout as JAX arrays on the default device."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    sizes = (shape.q_shape, shape.kv_shape, shape.kv_shape, shape.q_shape)
    return [jax.random.normal(key, size, dtype=jnp.float32).astype(dtype) for key, size in zip(keys, sizes)]


def loss_and_grads(causal, softmax_scale=None, deterministic=False, jit=True):
    """(q, k, v, dout) -> gradients of sum(out * dout), i.e. the backward fed dout."""
    def loss(q, k, v, dout):
        out = cuflash.jax.attention(q, k, v, causal, softmax_scale, deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(grad) if jit else grad


class Launches:
    """Records the pointers and stream of every kernel launch."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        _kernels._launch_observer = lambda pointers, stream: self.calls.append((pointers, stream))
        return self

    def __exit__(self, *exc):
        _kernels._launch_observer = None


# --- CPU: the glue itself ------------------------------------------------------------------


@pytest.fixture
def cpu():
    """Put arrays and jitted work on the CPU even where a GPU is the default device: that is
    also the device cuflash.jax assumes while tracing (a tracer has none yet)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_import_cuflash_does_not_import_jax():
    code = "import sys, cuflash; assert 'jax' not in sys.modules, 'import cuflash imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape", [Shape(2, 37, 29, 4, 2, 16, True), Shape(1, 20, 45, 3, 1, 8, False)])
@pytest.mark.parametrize("jit", [False, True])
def test_cpu_is_the_numpy_path(cpu, shape, dtype, jit):
    """Eager or jitted, forward and gradients are exactly cuflash.attention /
    attention_backward on the same NumPy arrays, and that is the attention gradient."""
    q, k, v, dout = make_inputs(shape, dtype, seed=shape.seqlen_q)
    forward = jax.jit(cuflash.jax.attention, static_argnums=(3,)) if jit else cuflash.jax.attention
    out = forward(q, k, v, shape.causal)
    grads = loss_and_grads(shape.causal, jit=jit)(q, k, v, dout)

    arrays = [np.asarray(x) for x in (q, k, v)]
    want_out, lse = cuflash.attention(*arrays, causal=shape.causal, return_lse=True)
    # The loss's gradient reaches out through a float32 cast: dout rounded to the input dtype.
    dout_in = np.asarray(dout.astype(jnp.float32)).astype(arrays[0].dtype)
    want = cuflash.attention_backward(dout_in, *arrays, want_out, lse, causal=shape.causal)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out), want_out)
    for grad, expected, like in zip(grads, want, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
        np.testing.assert_array_equal(np.asarray(grad), expected)
    refs = attention_reference_backward(dout_in, *arrays, causal=shape.causal)
    for grad, ref, name in zip(grads, refs, ("dq", "dk", "dv")):  # a wiring check, not accuracy
        assert_close(np.asarray(grad), ref, atol=1e-2 * max(1.0, float(abs(ref).max())), name=name)


def test_cpu_softmax_scale_and_vmap(cpu):
    shape = Shape(2, 19, 23, 4, 2, 8, True)
    q, k, v, _ = make_inputs(shape, jnp.float32)
    out = cuflash.jax.attention(q, k, v, True, 0.3)
    ref, _ = attention_reference(*(np.asarray(x) for x in (q, k, v)), causal=True, softmax_scale=0.3)
    assert_close(np.asarray(out), ref, atol=1e-5)
    # vmap over a leading axis: one call per mapped element.
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    outs = jax.jit(jax.vmap(lambda q, k, v: cuflash.jax.attention(q, k, v, True, 0.3)))(*stacked)
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(out))
    doubled = cuflash.jax.attention(2 * q, 2 * k, 2 * v, True, 0.3)
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(doubled))


def test_cpu_errors_are_raised_while_tracing(cpu):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        jax.jit(cuflash.jax.attention)(q, q[..., :8], q)
    with pytest.raises(TypeError, match="one dtype"):
        cuflash.jax.attention(q, q, q.astype(jnp.float16))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        cuflash.jax.attention(q, q, q, False, -1.0)


def test_missing_buffer_callback_names_the_jax_version(monkeypatch):
    monkeypatch.setattr(cuflash.jax, "buffer_callback", None)
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ImportError, match="JAX 0.7 or newer"):
        cuflash.jax.attention(q, q, q)


# --- GPU: the CUDA kernels on XLA's buffers ------------------------------------------------


def check_output(out, q, k, v, causal):
    """flash-attn's rule for the forward: max|out - ref64| <= 2 * max|out_lowp - ref64| + floor."""
    import cupy

    from .test_gpu_forward import FLOOR
    q, k, v = (cupy.from_dlpack(x) for x in (q, k, v))
    ref, _ = attention_reference(q, k, v, causal=causal)
    lowp_err = float(abs(attention_lowp(q, k, v, causal=causal) - ref).max()) if ref.size else 0.0
    assert_close(cupy.from_dlpack(out), ref, atol=2 * lowp_err + FLOOR[str(q.dtype)], name="out")


def check_gradients(grads, dout, q, k, v, causal, softmax_scale=None):
    """The GPU backward tests' rule (flash-attn's, with NaN/inf parity), on JAX arrays."""
    import cupy

    from .test_gpu_backward import check_gradients as check_cupy_gradients
    dout, q, k, v = (cupy.from_dlpack(x) for x in (dout, q, k, v))
    check_cupy_gradients(dout, q, k, v, [cupy.from_dlpack(g) for g in grads], causal, softmax_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 129, 65, 4, 2, 64, True), "bfloat16"),  # causal, seqlen_q > seqlen_k: masked rows
    (Shape(1, 200, 333, 6, 2, 128, False), "float16"),
    (Shape(2, 77, 300, 4, 1, 96, True), "bfloat16"),  # MQA, causal, seqlen_q < seqlen_k
    (Shape(1, 150, 150, 2, 2, 59, True), "float16"),  # odd head dim
])
@pytest.mark.parametrize("jit", [False, True])
def test_gradients_match_reference(shape, dtype, jit):
    q, k, v, dout = make_inputs(shape, getattr(jnp, dtype), seed=shape.seqlen_q)
    forward = jax.jit(cuflash.jax.attention, static_argnums=(3,)) if jit else cuflash.jax.attention
    out = forward(q, k, v, shape.causal)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    check_output(out, q, k, v, shape.causal)
    grads = loss_and_grads(shape.causal, jit=jit)(q, k, v, dout)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    check_gradients(grads, dout, q, k, v, shape.causal)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 191, 300, 4, 2, 64, True), "bfloat16"),
    (Shape(1, 200, 333, 6, 2, 128, False), "float16"),
])
def test_zero_copy(shape, dtype):
    """The kernel reads q, k, v where JAX keeps them and writes the buffer JAX hands back."""
    q, k, v, _ = make_inputs(shape, getattr(jnp, dtype))
    with Launches() as launches:
        out = cuflash.jax.attention(q, k, v, shape.causal)
        out.block_until_ready()
    (pointers, stream), = launches.calls
    assert pointers[:3] == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert pointers[3] == out.unsafe_buffer_pointer()


@pytest.mark.gpu
def test_deterministic_gradients_are_bitwise_reproducible():
    shape = Shape(2, 384, 1024, 8, 2, 64, True)
    q, k, v, dout = make_inputs(shape, jnp.bfloat16, seed=7)
    grads = loss_and_grads(True, deterministic=True)
    first = grads(q, k, v, dout)
    for _ in range(3):
        for a, b in zip(first, grads(q, k, v, dout)):
            assert bool(jnp.array_equal(a, b))
    check_gradients(first, dout, q, k, v, causal=True)
