"""JAX glue: differentiable attention that works eagerly and under jax.jit, zero-copy.

    import cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)
    grads = jax.jit(jax.grad(lambda q, k, v: cuflash.jax.attention(q, k, v).sum(), (0, 1, 2)))(q, k, v)

The forward and the backward are each one ``jax.experimental.buffer_callback``: XLA
allocates the outputs (and the backward's scratch buffers), hands the callback its device
buffers and its stream, and the kernels read and write those buffers in place on that
stream. Nothing is copied and nothing synchronises. ``jax.custom_vjp`` ties the two
together, so jax.grad, jax.jit and jax.vmap (one call per mapped element) all apply.

Arrays on the CPU take the same route: buffer_callback gives host buffers there, and the
callback runs the NumPy path on them (float16, float32, float64). One route for both means
jit needs no platform switch and the glue is testable without a GPU.

Inputs are checked while tracing, where an array under jit has no device yet: the checks
that differ between CPU and GPU (the dtypes) assume the default device, as jit does for
uncommitted arrays. Under ``with jax.default_device(cpu)`` they follow the CPU rules.

Needs JAX with ``jax.experimental.buffer_callback`` (0.7 or newer). Importing this module
imports jax; ``import cuflash`` alone does not.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _arrays, _kernels, api

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # older JAX: attention() says what to upgrade to
    buffer_callback = None

__all__ = ["attention"]

_DLPACK_CPU = 1  # kDLCPU in DLPack's DLDeviceType


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, *, deterministic: bool = False):
    """Differentiable ``cuflash.attention`` for JAX arrays: returns out.

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim);
    see ``cuflash.attention`` for the semantics. float16/bfloat16 on a GPU, float16/
    float32/float64 on the CPU. ``deterministic`` makes the backward bitwise reproducible.
    """
    if buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or newer); "
                          f"this is JAX {jax.__version__}: pip install -U jax")
    scale = _validate(q, k, v, causal, softmax_scale)
    return _attention(q, k, v, bool(causal), scale, bool(deterministic))


def _validate(q, k, v, causal, softmax_scale) -> float:
    """api._check on the shapes and dtypes (all that exists while tracing), so that user
    errors are raised here, not from inside a callback. Returns the softmax scale."""
    device = None if _platform(q) == "cpu" else 0  # only CPU vs GPU matters to the checks

    def describe(x):
        shape = tuple(x.shape)
        return _arrays.ArrayInfo(x, "jax", 0, shape, _arrays.contiguous_strides(shape), np.dtype(x.dtype).name, device)

    return api._check(describe(q), describe(k), describe(v), causal, softmax_scale)


def _platform(x) -> str:
    """Where x's computation runs: its device for a concrete array. A tracer (under jit
    or grad) has no device yet; uncommitted work goes to the default device, so assume
    that (jax.default_device, else the default backend)."""
    try:
        return next(iter(x.devices())).platform
    except Exception:  # a tracer (ConcretizationTypeError) or a NumPy array (AttributeError)
        default = jax.config.jax_default_device
        if default is None:
            return jax.default_backend()
        return default if isinstance(default, str) else default.platform


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal, scale, deterministic):
    return _forward(q, k, v, causal, scale)[0]


def _attention_fwd(q, k, v, causal, scale, deterministic):
    out, lse = _forward(q, k, v, causal, scale)
    return out, (q, k, v, out, lse)


def _attention_bwd(causal, scale, deterministic, residuals, dout):
    return _backward(dout, *residuals, causal, scale, deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, causal: bool, scale: float):
    batch, seqlen_q, nheads, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32))
    callback = _ForwardCallback(causal, scale, np.dtype(q.dtype).name)
    return buffer_callback(callback, results, vmap_method="sequential")(q, k, v)


def _backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool):
    grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    workspace = {name: jax.ShapeDtypeStruct(shape, dtype)
                 for name, (shape, dtype) in _kernels.backward_workspace(tuple(q.shape)).items()}
    callback = _BackwardCallback(causal, scale, deterministic, np.dtype(q.dtype).name)
    grads, _ = buffer_callback(callback, (grads, workspace), vmap_method="sequential")(dout, q, k, v, out, lse)
    return grads


# The callbacks are frozen dataclasses, hashable by value: JAX caches the compiled
# executable of an eager call on the callback's hash, so equal calls reuse it instead
# of compiling again.
#
# command_buffer_compatible stays off: with it XLA would run the Python once and replay a
# recorded CUDA graph, but the first call compiles the kernel with NVRTC, which must not
# happen inside a capture.


@dataclasses.dataclass(frozen=True)
class _ForwardCallback:
    causal: bool
    scale: float
    dtype: str  # of q, k, v, out; lse is float32

    def __call__(self, ctx, outputs, q, k, v):
        if _on_cpu(q):
            results = api.attention(*_host(q, k, v), causal=self.causal, softmax_scale=self.scale, return_lse=True)
            return _write(outputs, results)
        out, lse = outputs
        infos = [_info(x, self.dtype) for x in (q, k, v, out)] + [_info(lse, "float32")]
        _kernels.forward(*infos, causal=self.causal, scale=self.scale, stream=ctx.stream)


@dataclasses.dataclass(frozen=True)
class _BackwardCallback:
    causal: bool
    scale: float
    deterministic: bool
    dtype: str  # of dout, q, k, v, out and the gradients; lse and the workspace are float32

    def __call__(self, ctx, outputs, dout, q, k, v, out, lse):
        grads, workspace = outputs
        if _on_cpu(q):
            results = api.attention_backward(*_host(dout, q, k, v, out, lse), causal=self.causal,
                                             softmax_scale=self.scale, deterministic=self.deterministic)
            return _write(grads, results)  # the workspace is GPU scratch; unused here
        inputs = [_info(x, self.dtype) for x in (dout, q, k, v, out)] + [_info(lse, "float32")]
        grads = [_info(x, self.dtype) for x in grads]
        workspace = {name: _info(x, "float32") for name, x in workspace.items()}
        _kernels.backward(*inputs, *grads, **workspace, causal=self.causal, scale=self.scale,
                          deterministic=self.deterministic, stream=ctx.stream)


def _on_cpu(buffer) -> bool:
    return buffer.__dlpack_device__()[0] == _DLPACK_CPU


def _info(buffer, dtype: str) -> _arrays.ArrayInfo:
    """A device buffer as the kernels see it. XLA hands custom calls dense row-major
    buffers. The dtype comes from the caller: bfloat16 buffers describe themselves as
    raw 2-byte records ('<V2') in __cuda_array_interface__."""
    shape = tuple(buffer.shape)
    ptr = buffer.__cuda_array_interface__["data"][0]
    device = buffer.__dlpack_device__()[1]
    return _arrays.ArrayInfo(buffer, "jax", ptr, shape, _arrays.contiguous_strides(shape), dtype, device)


def _host(*buffers) -> list:
    return [np.asarray(b) for b in buffers]


def _write(buffers, arrays) -> None:
    # The CPU path returns fresh arrays; copy them into the buffers XLA allocated.
    for buffer, array in zip(buffers, arrays):
        np.asarray(buffer)[...] = array
