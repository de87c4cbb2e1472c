"""cuflash.torch (custom ops, autograd, torch.compile, CUDA graphs) and flash_attn_func.

The CPU tests run wherever torch is installed: CPU tensors take the NumPy path through the
same custom ops, so autograd, opcheck, torch.compile and the flash-attn conventions are
checked without a GPU. The tests marked gpu check the CUDA kernels through the same glue
against the float64 oracle with flash-attn's gradient rule:
max|grad - ref64| <= 3 * max|grad_lowp - ref64| + floor, where grad_lowp is plain attention's
backward in the input dtype and floor is the dtype's rounding noise at the gradient's scale.
"""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash import _kernels  # noqa: E402
from cuflash.flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)
from cuflash.reference import attention_reference, attention_reference_backward  # noqa: E402

from .strategies import Shape, assert_close  # noqa: E402

def make_inputs(shape: Shape, dtype, device, seed=0):
    """Fresh standard normal q, k, v (requiring grad) and dout."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(size, grad=True):
        x = torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(grad)

    return draw(shape.q_shape), draw(shape.kv_shape), draw(shape.kv_shape), draw(shape.q_shape, grad=False)


def gradients(q, k, v, dout, **kwargs):
    out = cuflash.torch.attention(q, k, v, **kwargs)
    return out, torch.autograd.grad(out, (q, k, v), dout)


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


def test_import_cuflash_does_not_import_torch():
    code = "import sys, cuflash; assert 'torch' not in sys.modules, 'import cuflash imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [Shape(2, 37, 29, 4, 2, 16, True), Shape(1, 20, 45, 3, 1, 8, False)])
def test_cpu_autograd_is_the_numpy_path(shape, dtype):
    """Autograd through the ops gives exactly what cuflash.attention / attention_backward
    give on the same NumPy arrays, and that is the attention gradient."""
    q, k, v, dout = make_inputs(shape, dtype, "cpu")
    out, grads = gradients(q, k, v, dout, causal=shape.causal)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want_out, lse = cuflash.attention(*arrays, causal=shape.causal, return_lse=True)
    want = cuflash.attention_backward(dout.numpy(), *arrays, want_out, lse, causal=shape.causal)
    assert out.dtype == dtype and out.is_contiguous()
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    for grad, expected, like in zip(grads, want, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
        np.testing.assert_array_equal(grad.numpy(), expected)
    refs = attention_reference_backward(dout.numpy(), *arrays, causal=shape.causal)
    for grad, ref, name in zip(grads, refs, ("dq", "dk", "dv")):  # a wiring check, not accuracy
        assert_close(grad.numpy(), ref, atol=1e-2 * max(1.0, float(abs(ref).max())), name=name)


def test_cpu_expanded_gradient_and_strided_inputs():
    """out.sum() sends an expanded (all-zero-stride) gradient; q may be a transposed view."""
    q, k, v, _ = make_inputs(Shape(2, 30, 30, 2, 2, 16, True), torch.float32, "cpu")
    q_t = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    cuflash.torch.attention(q_t, k, v, causal=True).sum().backward()
    _, expected = gradients(q, k, v, torch.ones(q.shape), causal=True)
    for grad, want in zip((q_t.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_cpu_lse_is_not_differentiable_and_softmax_scale_passes_through():
    q, k, v, _ = make_inputs(Shape(1, 9, 11, 2, 1, 8, False), torch.float64, "cpu")
    out, lse = cuflash.torch.attention_forward(q, k, v, False, 0.3, False)
    assert out.requires_grad and not lse.requires_grad
    ref_out, ref_lse = attention_reference(*(x.detach().numpy() for x in (q, k, v)), softmax_scale=0.3)
    assert_close(out.detach().numpy(), ref_out, atol=1e-10)
    assert_close(lse.numpy(), ref_lse, atol=1e-5)


def test_cpu_errors():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="bfloat16 CPU tensor"):
        cuflash.torch.attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    with pytest.raises(ValueError, match="k and v must have one shape"):
        cuflash.torch.attention(q, q[..., :8], q)
    with pytest.raises(TypeError, match="dtype must be one of"):
        cuflash.torch.attention(q.int(), q.int(), q.int())


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_cpu_opcheck(op):
    q, k, v, dout = make_inputs(Shape(2, 13, 17, 4, 2, 8, True), torch.float32, "cpu")
    _opcheck(op, q, k, v, dout)


def test_cpu_torch_compile_fullgraph():
    """No graph break, and the compiled forward + backward match eager (aot_eager: AOTAutograd
    traces both ops through their fake implementations, with no C++ toolchain needed)."""
    q, k, v, dout = make_inputs(Shape(2, 33, 21, 4, 2, 16, True), torch.float32, "cpu")
    _check_compiled(q, k, v, dout, backend="aot_eager")


# --- flash_attn_func: flash-attn's conventions -------------------------------------------


@pytest.mark.parametrize("kwargs,feature", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(window_size=(8, -1)), "window_size"),
    (dict(window_size=(-1, 3)), "window_size"),
    (dict(window_size=(8, -1), causal=True), "window_size"),
])
def test_flash_attn_func_unimplemented_features(kwargs, feature):
    q, k, v, _ = make_inputs(Shape(1, 16, 16, 4, 2, 8, False), torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match=feature):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("window_size,causal,expect_causal", [
    ((-1, -1), False, False),
    ((-1, -1), True, True),
    ((-1, 0), False, True),  # flash-attn: (unbounded, 0) is causal
    ((-5, -2), False, False),  # any negative side is unbounded
    ((40, 40), False, False),  # sides of at least seqlen_k are unbounded
    ((40, 3), True, True),  # causal overrides the right side
])
def test_flash_attn_func_window_equivalents(window_size, causal, expect_causal):
    q, k, v, dout = make_inputs(Shape(2, 23, 40, 4, 2, 8, False), torch.float32, "cpu")
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    want = cuflash.torch.attention(q, k, v, causal=expect_causal)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_flash_attn_func_return_conventions():
    q, k, v, dout = make_inputs(Shape(2, 23, 40, 4, 2, 8, True), torch.float32, "cpu")
    out = flash_attn_func(q, k, v, 0.0, 0.5, True)  # positional: dropout_p, softmax_scale, causal
    torch.testing.assert_close(out, cuflash.torch.attention(q, k, v, causal=True, softmax_scale=0.5), rtol=0, atol=0)
    out, softmax_lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert s_dmask is None
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (2, 4, 23)
    _, ref_lse = attention_reference(*(x.detach().numpy() for x in (q, k, v)), causal=True)
    assert_close(softmax_lse.numpy(), ref_lse, atol=1e-5)
    (out * dout).sum().backward()  # differentiable like flash-attn's
    _, expected = gradients(q.detach().requires_grad_(), k.detach().requires_grad_(),
                            v.detach().requires_grad_(), dout, causal=True)
    for grad, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)



def test_flash_attn_packed_variants():
    """qkv / kv stacked on dim 2 give flash_attn_func of their slices, gradients included."""
    qkv = torch.randn(2, 31, 3, 4, 16, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    expected = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    torch.testing.assert_close(dqkv, torch.stack(expected, dim=2), rtol=0, atol=0)

    kv = qkv.detach()[:, :, 1:].clone()
    out, lse, s_dmask = flash_attn_kvpacked_func(q, kv, softmax_scale=0.2, return_attn_probs=True)
    want, want_lse, _ = flash_attn_func(q, k, v, softmax_scale=0.2, return_attn_probs=True)
    assert s_dmask is None
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)

# --- helpers shared by the CPU and GPU tests ----------------------------------------------


def _opcheck(op, q, k, v, dout):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    if op == "forward":
        torch.library.opcheck(cuflash.torch.attention_forward, (q, k, v, True, None, False))
        torch.library.opcheck(cuflash.torch.attention_forward, (q.detach(), k.detach(), v.detach(), False, 0.5, True))
    else:
        args = [x.detach() for x in (q, k, v)]
        out, lse = cuflash.torch.attention_forward(*args, True, None, False)
        torch.library.opcheck(cuflash.torch.attention_backward, (dout, *args, out, lse, True, None, False))


def _check_compiled(q, k, v, dout, **compile_kwargs):
    def loss(q, k, v, dout):
        return (cuflash.torch.attention(q, k, v, causal=True, deterministic=True).float() * dout.float()).sum()

    assert torch._dynamo.explain(loss)(q, k, v, dout).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, **compile_kwargs)
    got = torch.autograd.grad(compiled(q, k, v, dout), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v, dout), (q, k, v))
    for g, w in zip(got, want):  # the same ops: equal up to the dtype's default tolerance
        torch.testing.assert_close(g, w)


# --- GPU: the CUDA kernels through the glue -----------------------------------------------


def check_gradients(grads, dout, q, k, v, causal, softmax_scale=None):
    """The GPU backward tests' rule (flash-attn's, with NaN/inf parity), on torch tensors."""
    import cupy

    from .test_gpu_backward import check_gradients as check_cupy_gradients
    dout, q, k, v = (cupy.from_dlpack(t.detach()) for t in (dout, q, k, v))
    check_cupy_gradients(dout, q, k, v, [cupy.from_dlpack(g) for g in grads], causal, softmax_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 129, 65, 4, 2, 64, True), torch.bfloat16),  # causal, seqlen_q > seqlen_k: masked rows
    (Shape(1, 200, 333, 6, 2, 128, False), torch.float16),
    (Shape(2, 77, 300, 4, 1, 96, True), torch.bfloat16),  # MQA, causal, seqlen_q < seqlen_k
    (Shape(1, 150, 150, 2, 2, 59, True), torch.float16),  # odd head dim
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_match_reference(shape, dtype, deterministic):
    q, k, v, dout = make_inputs(shape, dtype, "cuda", seed=shape.seqlen_q)
    out, grads = gradients(q, k, v, dout, causal=shape.causal, deterministic=deterministic)
    assert out.dtype == dtype and out.device == q.device
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape and grad.device == like.device
    check_gradients(grads, dout, q, k, v, shape.causal)


@pytest.mark.gpu
def test_expanded_gradient_on_a_side_stream_zero_copy():
    """out.sum()'s all-zero-stride gradient works; every launch of the forward and backward
    runs on the current stream, and the forward reads q, k, v and writes out in place."""
    q, k, v, _ = make_inputs(Shape(2, 100, 130, 4, 2, 64, True), torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), Launches() as launches:
        out = cuflash.torch.attention(q, k, v, causal=True)
        out.sum().backward()  # its gradient is ones expanded: all strides 0
    stream.synchronize()
    assert launches.calls and all(s == stream.cuda_stream for _, s in launches.calls)
    assert launches.calls[0][0][:4] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    check_gradients((q.grad, k.grad, v.grad), torch.ones_like(q), q, k, v, causal=True)


@pytest.mark.gpu
def test_deterministic_gradients_are_bitwise_reproducible():
    # Long seqlen_k and GQA: many key blocks add into each dq row and query heads into each dk.
    q, k, v, dout = make_inputs(Shape(2, 384, 1024, 8, 2, 64, True), torch.bfloat16, "cuda", seed=7)
    first = gradients(q, k, v, dout, causal=True, deterministic=True)[1]
    for _ in range(3):
        again = gradients(q, k, v, dout, causal=True, deterministic=True)[1]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_opcheck(op):
    q, k, v, dout = make_inputs(Shape(2, 70, 45, 4, 2, 64, True), torch.bfloat16, "cuda")
    _opcheck(op, q, k, v, dout)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    q, k, v, dout = make_inputs(Shape(2, 130, 97, 4, 2, 64, True), torch.bfloat16, "cuda")
    _check_compiled(q, k, v, dout)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Forward and backward captured once (after a warm-up that compiles the kernels), then
    replayed on new inputs: the same bits as eager (deterministic backward)."""
    shape = Shape(2, 150, 200, 4, 2, 128, False)
    q, k, v, dout = make_inputs(shape, torch.float16, "cuda", seed=1)

    def step():
        return gradients(q, k, v, dout, causal=False, deterministic=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles every kernel variant outside the capture
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_grads = step()

    fresh = make_inputs(shape, torch.float16, "cuda", seed=2)
    with torch.no_grad():
        for static, new in zip((q, k, v, dout), fresh):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()

    out, grads = step()
    assert torch.equal(static_out, out)
    for a, b in zip(static_grads, grads):
        assert torch.equal(a, b)
    check_gradients(static_grads, dout, q, k, v, causal=False)


@pytest.mark.gpu
def test_flash_attn_func_on_gpu():
    q, k, v, dout = make_inputs(Shape(2, 90, 120, 6, 3, 64, True), torch.bfloat16, "cuda")
    out, softmax_lse, s_dmask = flash_attn_func(q, k, v, window_size=(-1, 0), return_attn_probs=True)
    assert s_dmask is None and softmax_lse.shape == (2, 6, 90) and softmax_lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_gradients(grads, dout, q, k, v, causal=True)
    # Packed qkv: q, k, v are strided views (row stride 3 * nheads * headdim), read in place.
    qkv = torch.stack([q, q, q], dim=2).detach().requires_grad_()
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    views = [qkv.detach()[:, :, i] for i in range(3)]
    check_gradients(dqkv.unbind(dim=2), dout, *views, causal=True)
