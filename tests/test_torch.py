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

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

import cuflash  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash import _philox  # noqa: E402
from cuflash.flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from cuflash.reference import (  # noqa: E402
    attention_lowp,
    attention_reference,
    attention_reference_backward,
    attention_reference_varlen,
    attention_reference_varlen_backward,
    normalized_window,
)

from .strategies import (FRONT_END_SLOPES, Launches, Shape, VarlenShape, assert_close,  # noqa: E402
                         front_end_variants, numpy_options, reference_options)


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


def test_cpu_undefined_output_gradient_gives_undefined_input_gradients():
    """Zero gradients are not materialized: a consumer that sends none back reaches q, k, v as none."""
    class Detour(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    q, k, v, _ = make_inputs(Shape(1, 9, 11, 2, 1, 8, False), torch.float32, "cpu")
    out = cuflash.torch.attention(q, k, v)
    bias = torch.zeros((), requires_grad=True)
    (Detour.apply(out).sum() + bias).backward()
    assert q.grad is None and k.grad is None and v.grad is None and bias.grad == 1


def test_cpu_lse_is_differentiable_and_softmax_scale_passes_through():
    q, k, v, _ = make_inputs(Shape(1, 9, 11, 2, 1, 8, False), torch.float64, "cpu")
    out, lse, rng_state = cuflash.torch.attention_forward(q, k, v, False, 0.3, False)
    assert out.requires_grad and lse.requires_grad and not rng_state.requires_grad
    assert rng_state.dtype == torch.int64 and rng_state.device.type == "cpu" and rng_state.tolist() == [0, 0]
    ref_out, ref_lse = attention_reference(*(x.detach().numpy() for x in (q, k, v)), softmax_scale=0.3)
    assert_close(out.detach().numpy(), ref_out, atol=1e-10)
    assert_close(lse.detach().numpy(), ref_lse, atol=1e-5)


def test_cpu_errors():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="bfloat16 CPU tensor"):
        cuflash.torch.attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    with pytest.raises(ValueError, match="k and v must have one shape"):
        cuflash.torch.attention(q, q[..., :8], q)
    with pytest.raises(TypeError, match="dtype must be one of"):
        cuflash.torch.attention(q.int(), q.int(), q.int())


@pytest.mark.parametrize("op", ["forward", "backward", "varlen_forward", "varlen_backward"])
def test_cpu_opcheck(op):
    q, k, v, dout = make_inputs(Shape(2, 13, 17, 4, 2, 8, True), torch.float32, "cpu")
    _opcheck(op, q, k, v, dout)


def test_cpu_torch_compile_fullgraph():
    """No graph break, and the compiled forward + backward match eager (aot_eager: AOTAutograd
    traces both ops through their fake implementations, with no C++ toolchain needed)."""
    q, k, v, dout = make_inputs(Shape(2, 33, 21, 4, 2, 16, True), torch.float32, "cpu")
    _check_compiled(q, k, v, dout, backend="aot_eager")


def test_cpu_torch_compile_fullgraph_with_options():
    q, k, v, dout = make_inputs(Shape(2, 33, 21, 4, 2, 16, True), torch.float32, "cpu")
    options = dict(window_size=(9, 2), softcap=2.0, alibi_slopes=torch.rand(2, 4), dropout_p=0.25, seed=3)
    _check_compiled(q, k, v, dout, options, backend="aot_eager")


def test_cpu_torch_compile_draws_dropout_seeds_when_it_runs():
    """seed=None under torch.compile: each run draws from torch's generator (not one seed
    frozen at trace time), so torch.manual_seed reproduces a run, eager or compiled."""
    q, k, v, _ = make_inputs(Shape(1, 20, 20, 2, 2, 8, False), torch.float64, "cpu")

    def f(q, k, v):
        return cuflash.torch.attention(q, k, v, dropout_p=0.5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(q, k, v)  # compile outside the seeded runs
    torch.manual_seed(1)
    first, second = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(1)
    again = compiled(q, k, v)
    torch.manual_seed(1)
    eager = f(q, k, v)
    assert not torch.equal(first, second)
    assert torch.equal(first, again) and torch.equal(first, eager)


def test_cpu_torch_compile_varlen():
    shape = VarlenShape((9, 0, 17), (12, 5, 0), 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, torch.float32, "cpu")
    cu_q, cu_k = torch.from_numpy(shape.cu_seqlens_q), torch.from_numpy(shape.cu_seqlens_k)

    def loss(q, k, v, dout):
        out = cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, 17, 12, True, window_size=(4, 0), softcap=2.0,
                                             dropout_p=0.2, seed=9)
        return (out * dout).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, dout), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v, dout), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# --- CPU: the flash-attn options ----------------------------------------------------------

_SLOPES = torch.from_numpy(FRONT_END_SLOPES)
VARIANTS = front_end_variants(_SLOPES)


def _for_batch(kwargs: dict, batch: int, device="cpu") -> dict:
    """kwargs with (batch, nheads) ALiBi slopes cut to `batch` rows, on `device`."""
    kwargs = dict(kwargs)
    slopes = kwargs.get("alibi_slopes")
    if slopes is not None:
        kwargs["alibi_slopes"] = (slopes[:batch] if slopes.ndim == 2 else slopes).contiguous().to(device)
    return kwargs


def _close(got, want, name):
    """Agreement with the float64 oracle of a float64 computation (whose lse, and so the
    backward's recomputed P, is float32)."""
    assert_close(got.detach().numpy(), want, atol=1e-6 * max(1.0, float(abs(want).max(initial=0))), name=name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cpu_options_autograd_is_the_numpy_path(name):
    """Forward and gradients with every option are exactly cuflash.attention /
    attention_backward on the same NumPy arrays, and they are the oracle's."""
    causal, kwargs = VARIANTS[name]
    shape = Shape(2, 23, 31, 4, 2, 16, causal)
    kwargs = _for_batch(kwargs, shape.batch)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    out, grads = gradients(q, k, v, dout, causal=causal, **kwargs)

    arrays = [x.detach().numpy() for x in (q, k, v)]
    options = numpy_options(kwargs, causal=causal)
    want_out, lse = cuflash.attention(*arrays, return_lse=True, **options)
    want = cuflash.attention_backward(dout.numpy(), *arrays, want_out, lse, **options)
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    for grad, expected in zip(grads, want):
        np.testing.assert_array_equal(grad.numpy(), expected)

    keep = None
    if kwargs.get("dropout_p", 0) > 0:
        keep = _philox.keep_mask(kwargs["seed"], 0, shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k,
                                 kwargs["dropout_p"])
    ref_options = reference_options(kwargs, keep, causal=causal)
    _close(out, attention_reference(*arrays, **ref_options)[0], "out")
    for grad, ref, grad_name in zip(grads, attention_reference_backward(dout.numpy(), *arrays, **ref_options),
                                    ("dq", "dk", "dv")):
        _close(grad, ref, grad_name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cpu_varlen_autograd_is_the_numpy_path(name):
    """attention_varlen with every option (empty sequences included) is exactly
    cuflash.attention_varlen on NumPy arrays, and the oracle's, forward and gradients."""
    causal, kwargs = VARIANTS[name]
    shape = VarlenShape((9, 0, 17, 4), (12, 5, 0, 4), 4, 2, 16, causal)
    kwargs = _for_batch(kwargs, shape.batch)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    packing = (torch.from_numpy(cu_q), torch.from_numpy(cu_k), shape.max_seqlen_q, shape.max_seqlen_k)
    out = cuflash.torch.attention_varlen(q, k, v, *packing, causal, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    arrays = [x.detach().numpy() for x in (q, k, v)]
    options = numpy_options(kwargs, causal=causal)
    want_out, lse = cuflash.attention_varlen(*arrays, cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k,
                                             return_lse=True, **options)
    want = cuflash.attention_varlen_backward(dout.numpy(), *arrays, want_out, lse, cu_q, cu_k, shape.max_seqlen_q,
                                             shape.max_seqlen_k, **options)
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    for grad, expected in zip(grads, want):
        np.testing.assert_array_equal(grad.numpy(), expected)

    keep = None
    if kwargs.get("dropout_p", 0) > 0:
        keep = _philox.varlen_keep_masks(kwargs["seed"], 0, shape.nheads, shape.seqlens_q, shape.seqlens_k,
                                         kwargs["dropout_p"])
    ref_options = reference_options(kwargs, keep, causal=causal)
    _close(out, attention_reference_varlen(*arrays, cu_q, cu_k, **ref_options)[0], "out")
    refs = attention_reference_varlen_backward(dout.numpy(), *arrays, cu_q, cu_k, **ref_options)
    for grad, ref, grad_name in zip(grads, refs, ("dq", "dk", "dv")):
        _close(grad, ref, grad_name)


def test_cpu_dropout_seeds_come_from_torch_and_reach_the_backward():
    """seed=None draws from torch's generator: torch.manual_seed reproduces the mask, the
    next call gets another; rng_state says which, and the backward uses that mask."""
    shape = Shape(1, 17, 19, 2, 1, 8, False)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")

    def forward():
        return cuflash.torch.attention_forward(q, k, v, False, None, False, dropout_p=0.4)

    torch.manual_seed(0)
    first, second = forward(), forward()
    torch.manual_seed(0)
    again = forward()
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[2], second[2])

    out, _, rng_state = first
    seed, rng_offset = rng_state.tolist()
    keep = _philox.keep_mask(seed % 2**64, rng_offset, 1, 2, 17, 19, 0.4)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    _close(out, attention_reference(*arrays, dropout_p=0.4, dropout_keep=keep)[0], "out")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = attention_reference_backward(dout.numpy(), *arrays, dropout_p=0.4, dropout_keep=keep)
    for grad, ref, name in zip(grads, refs, ("dq", "dk", "dv")):
        _close(grad, ref, name)
    # An explicit seed is rng_state [seed, 0]; the ops carry seeds as int64 (2**64 - 1 is -1).
    out, _, rng_state = cuflash.torch.attention_forward(q, k, v, False, None, False, dropout_p=0.4, seed=-1)
    assert rng_state.tolist() == [-1, 0]
    assert torch.equal(out, cuflash.torch.attention(q, k, v, dropout_p=0.4, seed=2**64 - 1))


def test_cpu_option_errors():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="dropout_p"):
        cuflash.torch.attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="softcap"):
        cuflash.torch.attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cuflash.torch.attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        cuflash.torch.attention(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="window_size"):
        cuflash.torch.attention(q, q, q, window_size=(-2, 0))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        cuflash.torch.attention_varlen(q[0], q[0], q[0], cu.long(), cu, 8, 8)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        cuflash.torch.attention_varlen(q[0], q[0], q[0], cu, cu, 8, 4)


# --- flash_attn_func: flash-attn's conventions -------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flash_attn_func_passes_options_through(name):
    """flash_attn_func with flash-attn's keywords is cuflash.torch.attention with the same
    options, dropout seeds drawn from torch's generator alike."""
    causal, kwargs = VARIANTS[name]
    shape = Shape(2, 23, 31, 4, 2, 16, causal)
    kwargs = _for_batch(kwargs, shape.batch)
    kwargs.pop("seed", None)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    torch.manual_seed(5)
    out = flash_attn_func(q, k, v, causal=causal, deterministic=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.manual_seed(5)
    want_out, want = gradients(q, k, v, dout, causal=causal, **kwargs)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for grad, expected in zip(grads, want):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("window_size,causal,expect_causal", [
    ((-1, -1), False, False),
    ((-1, -1), True, True),
    ((-1, 0), False, True),  # flash-attn: (unbounded, 0) is causal
    ((40, 40), False, False),  # sides of at least seqlen_k are unbounded
    ((40, 3), True, True),  # causal overrides the right side
])
def test_flash_attn_func_window_equivalents(window_size, causal, expect_causal):
    q, k, v, dout = make_inputs(Shape(2, 23, 40, 4, 2, 8, False), torch.float32, "cpu")
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    want = cuflash.torch.attention(q, k, v, causal=expect_causal)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_flash_attn_window_size_may_hold_integer_tensors():
    """flash-attn's tests draw window_size with torch.randint; its binding takes the
    one-element tensors as ints. A float tensor is still refused, naming the argument."""
    q, k, v, _ = make_inputs(Shape(2, 23, 40, 4, 2, 8, False), torch.float32, "cpu")
    want = flash_attn_func(q, k, v, causal=True, window_size=(5, 7))
    for window in (torch.tensor([5, 7]), (torch.tensor(5), torch.tensor(7, dtype=torch.int32))):
        torch.testing.assert_close(flash_attn_func(q, k, v, causal=True, window_size=window), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="window_size left"):
        flash_attn_func(q, k, v, window_size=(torch.tensor(5.0), 7))


def test_flash_attn_func_return_conventions():
    q, k, v, dout = make_inputs(Shape(2, 23, 40, 4, 2, 8, True), torch.float32, "cpu")
    out = flash_attn_func(q, k, v, 0.0, 0.5, True)  # positional: dropout_p, softmax_scale, causal
    torch.testing.assert_close(out, cuflash.torch.attention(q, k, v, causal=True, softmax_scale=0.5), rtol=0, atol=0)
    out, softmax_lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert s_dmask is None  # no dropout, no mask
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (2, 4, 23)
    _, ref_lse = attention_reference(*(x.detach().numpy() for x in (q, k, v)), causal=True)
    assert_close(softmax_lse.detach().numpy(), ref_lse, atol=1e-5)
    (out * dout).sum().backward()  # differentiable like flash-attn's
    _, expected = gradients(q.detach().requires_grad_(), k.detach().requires_grad_(),
                            v.detach().requires_grad_(), dout, causal=True)
    for grad, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_flash_attn_func_dropout_mask_seeds_and_backward():
    """return_attn_probs gives flash-attn's S_dmask, whose sign bits are the keep mask the call
    used (about 1 - p of it kept); the backward reuses the forward's mask; torch.manual_seed
    reproduces a call."""
    shape = Shape(2, 40, 50, 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    torch.manual_seed(0)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert s_dmask.dtype == q.dtype and s_dmask.shape == (2, 4, 128, 128)
    keep = ~torch.signbit(s_dmask[..., :40, :50])
    assert abs(keep.double().mean().item() - 0.7) < 0.02
    arrays = [x.detach().numpy() for x in (q, k, v)]
    ref_options = dict(causal=True, dropout_p=0.3, dropout_keep=keep.numpy())
    _close(out, attention_reference(*arrays, **ref_options)[0], "out")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for grad, ref, name in zip(grads, attention_reference_backward(dout.numpy(), *arrays, **ref_options),
                               ("dq", "dk", "dv")):
        _close(grad, ref, name)
    torch.manual_seed(0)
    again, _, again_mask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    other, _, other_mask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert torch.equal(out, again) and torch.equal(s_dmask, again_mask)
    assert not torch.equal(out, other) and not torch.equal(s_dmask, other_mask)


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


def test_flash_attn_varlen_functions():
    """flash_attn_varlen_func with options against the oracle (its S_dmask giving each
    sequence's mask), and the packed varlen variants against it on their slices."""
    shape = VarlenShape((7, 0, 19, 3), (11, 3, 0, 3), 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    cu_q, cu_k = torch.from_numpy(shape.cu_seqlens_q), torch.from_numpy(shape.cu_seqlens_k)
    options = dict(dropout_p=0.2, causal=True, window_size=(5, -1), softcap=2.0, alibi_slopes=_SLOPES[2])
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 11, return_attn_probs=True, **options)
    assert lse.shape == (4, 29) and s_dmask.shape == (4, 4, 128, 128) and s_dmask.dtype == q.dtype
    keep = [~torch.signbit(s_dmask[b:b + 1, :, :sq, :sk]).numpy()
            for b, (sq, sk) in enumerate(zip(shape.seqlens_q, shape.seqlens_k))]
    arrays = [x.detach().numpy() for x in (q, k, v)]
    ref_options = reference_options(options, keep, causal=False)
    ref_options["causal"] = True
    _close(out, attention_reference_varlen(*arrays, cu_q.numpy(), cu_k.numpy(), **ref_options)[0], "out")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = attention_reference_varlen_backward(dout.numpy(), *arrays, cu_q.numpy(), cu_k.numpy(), **ref_options)
    for grad, ref, name in zip(grads, refs, ("dq", "dk", "dv")):
        _close(grad, ref, name)

    qkv = torch.randn(29, 3, 4, 16, dtype=torch.float64, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu_q, 19, causal=True, softcap=1.0)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_q, 19, 19, causal=True, softcap=1.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    expected = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(dqkv, torch.stack(expected, dim=1), rtol=0, atol=0)

    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_q, 19, 19, window_size=(3, 3))
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_q, 19, 19, window_size=(3, 3))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (dkv,) = torch.autograd.grad(out, kv, dout)
    torch.testing.assert_close(dkv, torch.stack(torch.autograd.grad(want, (k, v), dout), dim=1), rtol=0, atol=0)

    # k and v in pages of 4 rows, handed out in reverse: the packed call's result, and no backward
    rows = [(int(a), int(b)) for a, b in zip(cu_q[:-1], cu_q[1:])]
    table = torch.arange(len(rows) * 5, dtype=torch.int32).flip(0).reshape(len(rows), 5)
    pools = [torch.zeros(len(rows) * 5, 4, *x.shape[1:], dtype=x.dtype) for x in (k, v)]
    for b, (start, end) in enumerate(rows):
        for pool, x in zip(pools, (k, v)):
            seq = torch.zeros(20, *x.shape[1:], dtype=x.dtype)
            seq[:end - start] = x.detach()[start:end]
            pool[table[b].long()] = seq.reshape(5, 4, *x.shape[1:])
    with pytest.raises(RuntimeError, match="block_table"):  # at backward time (flash-attn runs the forward)
        flash_attn_varlen_func(q, *pools, cu_q, cu_q, 19, 19, block_table=table).sum().backward()
    with torch.no_grad():
        paged, lse, mask = flash_attn_varlen_func(q, *pools, cu_q, cu_q, 19, 19, causal=True, block_table=table,
                                                  return_attn_probs=True)
        want, want_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_q, 19, 19, causal=True, return_attn_probs=True)
    assert mask is None
    torch.testing.assert_close(paged, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


# --- CPU: the gradient of the LSE --------------------------------------------------------


def plain_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None):
    """Attention written out in torch ops, for autograd to differentiate: (out, lse) laid out
    as cuflash's, lse +inf on a row that sees no key. Such a row scores 0 before the softmax
    and is dropped after it, so that autograd never meets -inf - -inf."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rows, cols = (torch.arange(n, device=q.device) for n in (seqlen_q, seqlen_k))
    offset = cols[None, :] - (rows[:, None] + seqlen_k - seqlen_q)  # the key's distance right of the diagonal
    if alibi_slopes is not None:
        s = s - alibi_slopes.reshape(-1, nheads, 1, 1).to(s.dtype) * offset.abs()
    left, right = normalized_window(window_size, causal, seqlen_k)
    visible = ((left < 0) | (offset >= -left)) & ((right < 0) | (offset <= right))
    sees = visible.any(dim=-1)
    s = torch.where(sees[:, None], torch.where(visible, s, -torch.inf), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)
    return torch.where(sees[:, None, None], out, 0.0), torch.where(sees, torch.logsumexp(s, dim=-1), torch.inf)


def lse_gradient(lse, seed, poison=float("nan")):
    """A standard normal gradient for lse, `poison` on the rows whose lse is +inf (rows that
    see no key, whose lse gradient must be ignored)."""
    generator = torch.Generator(device=lse.device).manual_seed(seed)
    dlse = torch.randn(lse.shape, generator=generator, device=lse.device)
    return torch.where(torch.isinf(lse), poison, dlse)


def _seen(x, lse):
    return torch.where(torch.isfinite(lse), x, 0.0)


def _plain_gradients(q, k, v, dout, dlse, **kwargs):
    """plain_attention's (out, lse) in float64 and autograd's q, k, v gradients of
    <dout, out> + <dlse, lse> over the rows that see a key."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = plain_attention(q, k, v, **kwargs)
    loss = (out * dout.double()).sum() + (_seen(lse, lse) * _seen(dlse.double(), lse)).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, (q, k, v))


LSE_CASES = {
    "causal_gqa_unseeing_rows": (Shape(2, 37, 29, 4, 2, 16, True), {}),  # rows 0..7 see no key
    "mqa_scale": (Shape(1, 20, 45, 3, 1, 8, False), dict(softmax_scale=0.3)),
    "options": (Shape(2, 23, 31, 4, 2, 16, True), dict(window_size=(9, 0), softcap=3.0, alibi_slopes=_SLOPES[1])),
}


@pytest.mark.parametrize("name", list(LSE_CASES))
def test_cpu_lse_gradients_match_torch_autograd(name):
    """Gradients through out and lse together are autograd's through plain attention in
    float64; a NaN gradient on the lse of a row that sees no key changes nothing; out and lse
    alone add up to both; flash_attn_func's softmax_lse is the same lse."""
    shape, kwargs = LSE_CASES[name]
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    out, lse = cuflash.torch.attention(q, k, v, causal=shape.causal, return_lse=True, **kwargs)
    dlse = lse_gradient(lse, seed=1)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True)
    ref_out, ref_lse, want = _plain_gradients(q, k, v, dout, dlse, causal=shape.causal, **kwargs)
    _close(out, ref_out.numpy(), "out")
    assert_close(lse.detach().numpy(), ref_lse.numpy(), atol=1e-5, rtol=1e-6, name="lse")
    for grad, ref, grad_name in zip(grads, want, ("dq", "dk", "dv")):
        assert torch.isfinite(grad).all(), grad_name
        _close(grad, ref.numpy(), grad_name)

    out_only = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    lse_only = torch.autograd.grad(lse, (q, k, v), dlse)  # out's gradient undefined: a zero dout
    assert not lse_only[2].any()  # v does not reach lse
    for grad, a, b, grad_name in zip(grads, out_only, lse_only, ("dq", "dk", "dv")):
        _close(a + b, grad.numpy(), grad_name)

    fa_out, softmax_lse, _ = flash_attn_func(q, k, v, causal=shape.causal, return_attn_probs=True, **kwargs)
    fa_grads = torch.autograd.grad((fa_out, softmax_lse), (q, k, v), (dout, dlse))
    for fa_grad, grad in zip(fa_grads, grads):
        torch.testing.assert_close(fa_grad, grad, rtol=0, atol=0)


def test_cpu_varlen_lse_gradients_match_torch_autograd():
    """Packed sequences (one with no rows, one with no keys, causal rows that see none):
    gradients through out and lse are autograd's through plain attention per sequence."""
    shape = VarlenShape((9, 0, 17, 4, 11), (12, 5, 0, 4, 6), 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, torch.float64, "cpu")
    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    packing = (torch.from_numpy(cu_q), torch.from_numpy(cu_k), shape.max_seqlen_q, shape.max_seqlen_k)
    kwargs = dict(window_size=(6, -1), softcap=2.0)
    out, lse = cuflash.torch.attention_varlen(q, k, v, *packing, True, return_lse=True, **kwargs)
    dlse = lse_gradient(lse, seed=2)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))

    qd, kd, vd = (x.detach().requires_grad_() for x in (q, k, v))
    loss = 0.0
    for b in range(shape.batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = plain_attention(qd[None, rows_q], kd[None, rows_k], vd[None, rows_k], causal=True, **kwargs)
        loss = loss + (o[0] * dout[rows_q]).sum() + (_seen(l[0], l[0]) * _seen(dlse[:, rows_q].double(), l[0])).sum()
        _close(out[rows_q], o[0].detach().numpy(), "out")
        assert_close(lse[:, rows_q].detach().numpy(), l[0].detach().numpy(), atol=1e-5, rtol=1e-6, name="lse")
    want = torch.autograd.grad(loss, (qd, kd, vd))
    for grad, ref, name in zip(grads, want, ("dq", "dk", "dv")):
        assert torch.isfinite(grad).all(), name
        _close(grad, ref.numpy(), name)

    fa_out, softmax_lse, _ = flash_attn_varlen_func(q, k, v, *packing, causal=True, return_attn_probs=True,
                                                    **kwargs)
    fa_grads = torch.autograd.grad((fa_out, softmax_lse), (q, k, v), (dout, dlse))
    for fa_grad, grad in zip(fa_grads, grads):
        torch.testing.assert_close(fa_grad, grad, rtol=0, atol=0)


def merged_by_lse(q, k, v, split, **kwargs):
    """Attention over keys [:split] and over keys [split:], merged by their LSEs:
    lse = logaddexp(lse1, lse2), out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse) (in
    float32, float64 for float64 inputs). Returns (out, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out1, lse1 = cuflash.torch.attention(q, k[:, :split], v[:, :split], return_lse=True, **kwargs)
    out2, lse2 = cuflash.torch.attention(q, k[:, split:], v[:, split:], return_lse=True, **kwargs)
    lse = torch.logaddexp(lse1, lse2)

    def weighted(out, part_lse):  # lse (batch, nheads, seqlen_q) -> (batch, seqlen_q, nheads, 1)
        return out.to(acc) * torch.exp(part_lse - lse).transpose(1, 2).unsqueeze(-1).to(acc)

    return (weighted(out1, lse1) + weighted(out2, lse2)).to(q.dtype), lse


def check_merged(out, lse, grads, dout, q, k, v):
    """flash-attn's rules for out and the gradients, an absolute bound for lse, against the
    float64 oracle of full attention; CPU or CUDA tensors."""
    from .test_gpu_backward import check_gradients as check_array_gradients
    from .test_gpu_forward import FLOOR, LSE_ATOL
    tensors = (out, lse, dout, q, k, v, *grads)
    out, lse, dout, q, k, v, *grads = _cupy(*tensors) if q.is_cuda else [t.detach().numpy() for t in tensors]
    ref, ref_lse = attention_reference(q, k, v)
    lowp_err = float(abs(attention_lowp(q, k, v) - ref).max())
    assert_close(out, ref, atol=2 * lowp_err + FLOOR[str(q.dtype)], name="out")
    assert_close(lse, ref_lse, atol=LSE_ATOL, rtol=1e-5, name="lse")
    check_array_gradients(dout, q, k, v, grads, causal=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_cpu_merging_halves_by_lse_is_full_attention(dtype):
    """Attention over two halves of the keys merged by their LSEs is full attention, and so
    are its gradients, which reach q, k and v through both LSEs."""
    shape = Shape(2, 33, 50, 4, 2, 16, False)
    q, k, v, dout = make_inputs(shape, dtype, "cpu", seed=5)
    out, lse = merged_by_lse(q, k, v, 23)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if dtype != torch.float64:
        check_merged(out, lse, grads, dout, q, k, v)
        return
    full, full_lse = cuflash.torch.attention(q, k, v, return_lse=True)
    _close(out, full.detach().numpy(), "out")
    assert_close(lse.detach().numpy(), full_lse.detach().numpy(), atol=1e-5, rtol=1e-6, name="lse")
    full_grads = torch.autograd.grad(full, (q, k, v), dout)
    refs = attention_reference_backward(*(x.detach().numpy() for x in (dout, q, k, v)))
    for grad, full_grad, ref, name in zip(grads, full_grads, refs, ("dq", "dk", "dv")):
        _close(grad, full_grad.numpy(), name)
        _close(grad, ref, name)


def test_cpu_torch_compile_lse_gradients():
    """A loss over out and lse (and one over lse alone) compiles whole and matches eager."""
    q, k, v, dout = make_inputs(Shape(2, 33, 21, 4, 2, 16, True), torch.float32, "cpu")
    dlse = torch.randn(2, 4, 33)

    def loss(q, k, v, dout, dlse):
        out, lse = cuflash.torch.attention(q, k, v, causal=True, return_lse=True, softcap=2.0)
        return (out * dout).sum() + (_seen(lse, lse) * dlse).sum()

    def lse_loss(q, k, v, dout, dlse):
        _, lse = cuflash.torch.attention(q, k, v, causal=True, return_lse=True)
        return (_seen(lse, lse) * dlse).sum()

    for f in (loss, lse_loss):
        assert torch._dynamo.explain(f)(q, k, v, dout, dlse).graph_break_count == 0
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(compiled(q, k, v, dout, dlse), (q, k, v))
        want = torch.autograd.grad(f(q, k, v, dout, dlse), (q, k, v))
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w)


# --- helpers shared by the CPU and GPU tests ----------------------------------------------

_OPCHECK_OPTIONS = (5, 3, 2.0)  # window_left, window_right, softcap


def _opcheck(op, q, k, v, dout):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch;
    without options and with all of them (dropout by an explicit seed, so that runs agree);
    the backward with and without lse's gradient."""
    args = [x.detach() for x in (q, k, v)]
    nheads = q.shape[-2]
    slopes = torch.linspace(0.1, 0.8, nheads, device=q.device)
    if op.startswith("varlen"):
        # Three sequences of q's and k's rows (one empty), packed from batch element 0.
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        cu_q = torch.tensor([0, seqlen_q // 2, seqlen_q // 2, seqlen_q], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, 1, seqlen_k - 3, seqlen_k], dtype=torch.int32, device=q.device)
        packing = (cu_q, cu_k, seqlen_q, seqlen_k)
        q, k, v, dout = (x[0].detach().requires_grad_(x.requires_grad) for x in (q, k, v, dout))
        args = [x.detach() for x in (q, k, v)]
        forward, backward = cuflash.torch.attention_varlen_forward, cuflash.torch.attention_varlen_backward
    else:
        packing = ()
        forward, backward = cuflash.torch.attention_forward, cuflash.torch.attention_backward
    options = (*_OPCHECK_OPTIONS, slopes, 0.3)
    if op.endswith("forward"):
        torch.library.opcheck(forward, (q, k, v, *packing, True, None, False))
        torch.library.opcheck(forward, (*args, *packing, False, 0.5, True))
        torch.library.opcheck(forward, (q, k, v, *packing, True, None, False, *options, 7))
    else:
        out, lse, _ = forward(*args, *packing, True, None, False)
        dlse = torch.randn(lse.shape, device=lse.device)
        torch.library.opcheck(backward, (dout, *args, out, lse, *packing, True, None, False))
        torch.library.opcheck(backward, (dout, *args, out, lse, *packing, True, None, False, -1, -1, 0.0, None, 0.0,
                                         None, dlse))
        out, lse, rng_state = forward(*args, *packing, True, None, False, *options, 7)
        torch.library.opcheck(backward, (dout, *args, out, lse, *packing, True, None, False, *options, rng_state))
        torch.library.opcheck(backward, (dout, *args, out, lse, *packing, True, None, False, *options, rng_state,
                                         dlse))


def _check_compiled(q, k, v, dout, options=None, **compile_kwargs):
    def loss(q, k, v, dout):
        out = cuflash.torch.attention(q, k, v, causal=True, deterministic=True, **(options or {}))
        return (out.float() * dout.float()).sum()

    assert torch._dynamo.explain(loss)(q, k, v, dout).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, **compile_kwargs)
    got = torch.autograd.grad(compiled(q, k, v, dout), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v, dout), (q, k, v))
    for g, w in zip(got, want):  # the same ops: equal up to the dtype's default tolerance
        torch.testing.assert_close(g, w)


# --- GPU: the CUDA kernels through the glue -----------------------------------------------


def check_gradients(grads, dout, q, k, v, causal, softmax_scale=None, dlse=None):
    """The GPU backward tests' rule (flash-attn's, with NaN/inf parity), on torch tensors;
    with dlse, for the gradients of out and lse together."""
    import cupy

    from .test_gpu_backward import check_gradients as check_cupy_gradients
    dout, q, k, v = (cupy.from_dlpack(t.detach()) for t in (dout, q, k, v))
    check_cupy_gradients(dout, q, k, v, [cupy.from_dlpack(g) for g in grads], causal, softmax_scale,
                         dlse=None if dlse is None else cupy.from_dlpack(dlse))


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
@pytest.mark.parametrize("op", ["forward", "backward", "varlen_forward", "varlen_backward"])
def test_opcheck(op):
    q, k, v, dout = make_inputs(Shape(2, 70, 45, 4, 2, 64, True), torch.bfloat16, "cuda")
    _opcheck(op, q, k, v, dout)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    q, k, v, dout = make_inputs(Shape(2, 130, 97, 4, 2, 64, True), torch.bfloat16, "cuda")
    _check_compiled(q, k, v, dout)


def _capture(step):
    """A CUDA graph of ``step()`` and the outputs of the captured call. One call on a side
    stream first compiles every kernel variant, which must not happen during capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def _replay(graph, inputs, fresh, renew=lambda: None):
    """``graph`` replayed on new values: ``fresh`` copied into its ``inputs`` (and whatever
    else ``renew`` renews in place), then the device synchronised."""
    with torch.no_grad():
        for static, new in zip(inputs, fresh):
            static.copy_(new)
        renew()
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_capture_and_replay(deterministic, causal):
    """Forward and backward captured once (after a warm-up that compiles the kernels), then
    replayed on new inputs: the same bits as eager, but for the last bits of dq where it is
    added up with atomics (the one-pass backward zeroes its accumulator inside the graph,
    so every replay starts clean, as the sm_90a forward's tile counter under a causal
    mask)."""
    shape = Shape(2, 150, 200, 4, 2, 128, causal)
    q, k, v, dout = make_inputs(shape, torch.float16, "cuda", seed=1)

    def step():
        return gradients(q, k, v, dout, causal=causal, deterministic=deterministic)

    graph, (static_out, static_grads) = _capture(step)
    _replay(graph, (q, k, v, dout), make_inputs(shape, torch.float16, "cuda", seed=2))

    out, grads = step()
    assert torch.equal(static_out, out)
    assert torch.equal(static_grads[1], grads[1]) and torch.equal(static_grads[2], grads[2])
    if deterministic:
        assert torch.equal(static_grads[0], grads[0])
    else:
        torch.testing.assert_close(static_grads[0], grads[0], rtol=1e-2, atol=1e-3)
    check_gradients(static_grads, dout, q, k, v, causal=causal)


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


# --- GPU: the options through the glue ---------------------------------------------------


def _cupy(*tensors):
    import cupy
    return [None if t is None else cupy.from_dlpack(t.detach()) for t in tensors]


def _kernel_options(kwargs: dict, causal: bool, rng_state=None) -> dict:
    """cuflash.attention's keywords (CuPy slopes) for the checks of test_gpu_variants, the
    dropout seed and offset read from the call's rng_state."""
    options = dict(kwargs, causal=causal)
    options["alibi_slopes"] = _cupy(options.get("alibi_slopes"))[0]
    if rng_state is not None:
        seed, options["rng_offset"] = rng_state.tolist()
        options["seed"] = seed % 2**64
    return options


def _cuda_generator_state():
    """(seed, rng_offset) the next dropout call with seed=None will use."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    return generator.initial_seed(), generator.get_offset() // 4


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_options_match_reference(name, dtype):
    """Every option through the custom ops on the GPU, forward and gradients, against the
    oracle; dropout seeds drawn from torch's CUDA generator (its seed and Philox offset,
    which the call advances), and the backward given the forward's."""
    from .test_gpu_variants import check_forward, check_gradients as check_variant_gradients
    causal, kwargs = VARIANTS[name]
    shape = Shape(2, 150, 230, 4, 2, 64, causal)
    kwargs = _for_batch(kwargs, shape.batch, "cuda")
    kwargs.pop("seed", None)
    q, k, v, dout = make_inputs(shape, dtype, "cuda", seed=3)
    expected_state = _cuda_generator_state()
    left, right = kwargs.get("window_size", (-1, -1))
    out, lse, rng_state = cuflash.torch.attention_forward(q, k, v, causal, None, False, left, right,
                                                          kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"),
                                                          kwargs.get("dropout_p", 0.0))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if kwargs.get("dropout_p", 0) > 0:
        assert tuple(rng_state.tolist()) == (expected_state[0] - 2**64 * (expected_state[0] >= 2**63),
                                             expected_state[1])
        assert _cuda_generator_state()[1] == expected_state[1] + 1
    options = _kernel_options(kwargs, causal, rng_state)
    check_forward(*_cupy(q, k, v, out, lse), options)
    check_variant_gradients(*_cupy(dout, q, k, v), _cupy(*grads), options, out=_cupy(out)[0])


@pytest.mark.gpu
def test_dropout_reproduces_under_manual_seed():
    q, k, v, dout = make_inputs(Shape(2, 130, 170, 4, 2, 64, True), torch.bfloat16, "cuda")

    def run():
        return gradients(q, k, v, dout, causal=True, dropout_p=0.2, deterministic=True)

    torch.manual_seed(0)
    first, second = run(), run()
    torch.manual_seed(0)
    again = run()
    for a, b in zip((first[0], *first[1]), (again[0], *again[1])):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], second[0])


@pytest.mark.gpu
def test_torch_compile_fullgraph_with_options():
    q, k, v, dout = make_inputs(Shape(2, 130, 97, 4, 2, 64, True), torch.bfloat16, "cuda")
    options = dict(window_size=(40, 0), softcap=5.0, alibi_slopes=_SLOPES[:2].contiguous().cuda(), dropout_p=0.1,
                   seed=5)
    _check_compiled(q, k, v, dout, options)


@pytest.mark.gpu
def test_flash_attn_varlen_func_on_gpu():
    """Packed sequences (one empty) with every option: forward and gradients against the
    oracle, the dropout seed being what torch's CUDA generator held before the call."""
    from .test_gpu_variants import check_forward, check_gradients as check_variant_gradients
    shape = VarlenShape((100, 0, 257, 64), (130, 40, 0, 300), 4, 2, 128, True)
    q, k, v, dout = make_inputs(shape, torch.bfloat16, "cuda", seed=4)
    cu_q, cu_k = (torch.from_numpy(c).cuda() for c in (shape.cu_seqlens_q, shape.cu_seqlens_k))
    kwargs = dict(dropout_p=0.15, window_size=(50, 10), softcap=8.0, alibi_slopes=_SLOPES.cuda())
    seed, rng_offset = _cuda_generator_state()
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k,
                                               causal=True, return_attn_probs=True, **kwargs)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and s_dmask.shape == (4, 4, 384, 384)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    options = dict(_kernel_options(kwargs, True), seed=seed, rng_offset=rng_offset)
    varlen = _cupy(cu_q, cu_k)
    check_forward(*_cupy(q, k, v, out, lse), options, varlen=varlen)
    check_variant_gradients(*_cupy(dout, q, k, v), _cupy(*grads), options, varlen=varlen, out=_cupy(out)[0])


# --- GPU: the gradient of the LSE ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 129, 65, 4, 2, 64, True), torch.bfloat16),  # causal, seqlen_q > seqlen_k: rows that see no key
    (Shape(1, 200, 333, 6, 2, 128, False), torch.float16),
    (Shape(1, 150, 150, 2, 2, 59, True), torch.float16),  # odd head dim: the preprocess's unvectorized path
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_lse_gradients_match_reference(shape, dtype, deterministic):
    """Gradients through out and lse together (NaN on the lse of rows that see no key),
    against the oracle's with flash-attn's rule; flash_attn_func's softmax_lse is the same."""
    q, k, v, dout = make_inputs(shape, dtype, "cuda", seed=shape.seqlen_q)
    out, lse = cuflash.torch.attention(q, k, v, causal=shape.causal, deterministic=deterministic, return_lse=True)
    dlse = lse_gradient(lse, seed=1)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    for grad in grads:
        assert torch.isfinite(grad).all()
    check_gradients(grads, dout, q, k, v, shape.causal, dlse=dlse)
    fa_out, softmax_lse, _ = flash_attn_func(q, k, v, causal=shape.causal, deterministic=deterministic,
                                             return_attn_probs=True)
    fa_grads = torch.autograd.grad((fa_out, softmax_lse), (q, k, v), (dout, dlse))
    check_gradients(fa_grads, dout, q, k, v, shape.causal, dlse=dlse)


@pytest.mark.gpu
def test_varlen_lse_gradients_match_reference():
    """Packed sequences (one with no rows, one with no keys) through flash_attn_varlen_func's
    softmax_lse: the gradients of out and lse together against the oracle's."""
    import cupy

    from .test_gpu_backward import check_gradients as check_cupy_gradients
    shape = VarlenShape((100, 0, 257, 64), (130, 40, 0, 300), 4, 2, 128, True)
    q, k, v, dout = make_inputs(shape, torch.bfloat16, "cuda", seed=8)
    cu_q, cu_k = (torch.from_numpy(c).cuda() for c in (shape.cu_seqlens_q, shape.cu_seqlens_k))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k, causal=True,
                                         return_attn_probs=True)
    dlse = lse_gradient(lse, seed=3)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    for grad in grads:
        assert torch.isfinite(grad).all()
    check_cupy_gradients(*_cupy(dout, q, k, v), _cupy(*grads), True, dlse=cupy.from_dlpack(dlse),
                         varlen=_cupy(cu_q, cu_k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merging_halves_by_lse_on_gpu(dtype):
    """Two halves of the keys merged by their LSEs: out, lse and the gradients of q, k, v
    through the merge are full attention's, by flash-attn's rules."""
    q, k, v, dout = make_inputs(Shape(2, 200, 333, 4, 2, 64, False), dtype, "cuda", seed=9)
    out, lse = merged_by_lse(q, k, v, 130)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_merged(out, lse, grads, dout, q, k, v)


@pytest.mark.gpu
def test_cuda_graph_with_lse_gradients():
    """A step whose loss uses lse, captured and replayed on new inputs: the bits of eager."""
    shape = Shape(2, 150, 100, 4, 2, 64, True)  # rows 0..49 see no key
    q, k, v, dout = make_inputs(shape, torch.bfloat16, "cuda", seed=1)
    dlse = torch.randn(2, 4, 150, device="cuda")

    def step():
        out, lse = cuflash.torch.attention(q, k, v, causal=True, deterministic=True, return_lse=True)
        return lse, torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))

    graph, (static_lse, static_grads) = _capture(step)
    _replay(graph, (q, k, v, dout), make_inputs(shape, torch.bfloat16, "cuda", seed=2), dlse.normal_)
    lse, grads = step()
    assert torch.equal(static_lse, lse)
    for static, eager in zip(static_grads, grads):
        assert torch.equal(static, eager)
    check_gradients(grads, dout, q, k, v, causal=True, dlse=dlse)
