"""The sm_90a forward (cuda/sm90/fwd.cu), while it is brought up: every instance compiles
for sm_90a with no spill and no ptxas C75xx warning (setmaxnreg ignored, wgmma
serialised), the host's argument layout matches the kernel's (its shared memory:
tests/test_plan.py), and on a Hopper GPU the output and LSE match the float64 oracle and
the mma.sync kernel."""
import ctypes

import numpy as np
import pytest

from cuflash import _compile, _plan, _sm90


@pytest.mark.parametrize("kernel", _plan.all_kernels("sm_90a"), ids=lambda k: k.instance)
def test_every_instance_compiles_clean_for_sm90a(kernel):
    """(compile_kernel refuses a ptxas C75xx warning: setmaxnreg ignored, wgmma serialised)"""
    resources = _compile._run_nvrtc(kernel.source, kernel.instance,
                                    ("--gpu-architecture=sm_90a", *_compile.OPTIONS)).resources
    assert resources.spill_stores == 0 and resources.stack_bytes == 0, resources


def test_the_arguments_put_the_maps_on_64_byte_boundaries():
    from cuflash._params import Params
    from cuflash._tensormap import TensorMap
    maps = [TensorMap() for _ in range(3)]
    for i, m in enumerate(maps):
        m.v[0] = i + 1
    args = _sm90.arguments(Params(), maps)
    start = -(-ctypes.sizeof(Params) // 64) * 64
    assert len(args.raw) == start + 3 * 128
    for i in range(3):
        assert int.from_bytes(args.raw[start + 128 * i:start + 128 * i + 8], "little") == i + 1


def _hopper() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0 and cupy.cuda.Device(0).compute_capability == "90"
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU (H100, H200)")
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_k", [
    (1, 128, 128, 1, 1), (2, 1, 300, 4, 2), (1, 129, 257, 2, 2), (2, 300, 517, 4, 1), (1, 1000, 1000, 2, 2),
    (1, 2048, 2048, 4, 4)])
@pytest.mark.parametrize("causal,window_size,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                    (False, (200, 30), 0.0), (True, (-1, -1), 20.0)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("specialised", [False, True])
def test_the_sm90_forward_matches_the_oracle(batch, seqlen_q, seqlen_k, heads, heads_k, causal, window_size, softcap,
                                             dtype, specialised):
    import cupy

    import cuflash
    from cuflash.reference import attention_reference

    from .test_gpu_forward import cupy_dtype
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k)
    shapes = ((batch, seqlen_q, heads, 128), (batch, seqlen_k, heads_k, 128), (batch, seqlen_k, heads_k, 128))
    host = [rng.standard_normal(s).astype(cupy_dtype(dtype)) for s in shapes]
    q, k, v = (cupy.asarray(x) for x in host)
    options = dict(causal=causal, window_size=window_size, softcap=softcap)
    out, lse = _sm90.forward(q, k, v, specialised=specialised, **options)
    want, want_lse = attention_reference(*(cupy.asarray(x.astype(np.float64)) for x in host), **options)
    scale = 1 + float(abs(want).max())
    np.testing.assert_allclose(out.get().astype(np.float64), want.get(), atol=4e-3 * scale)
    finite = np.isfinite(want_lse.get())
    np.testing.assert_allclose(lse.get()[finite], want_lse.get()[finite], atol=1e-3)
    same, same_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    np.testing.assert_allclose(out.get().astype(np.float64), same.get().astype(np.float64), atol=4e-3 * scale)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU (H100, H200)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("specialised", [False, True])
def test_the_sm90_varlen_forward_matches_the_packed_call(causal, specialised):
    """Packed sequences of ragged lengths (1, a tile + 1, primes): the same as the mma.sync
    varlen call, and no row written outside its sequence."""
    import cupy

    import cuflash
    rng = np.random.default_rng(3)
    lengths_q, lengths_k = np.array([1, 129, 211, 64, 997]), np.array([300, 129, 17, 640, 1000])
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q = cupy.asarray(rng.standard_normal((lengths_q.sum(), 4, 128)).astype(np.float16))
    k, v = (cupy.asarray(rng.standard_normal((lengths_k.sum(), 2, 128)).astype(np.float16)) for _ in "kv")
    args = (q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()))
    out, lse = _sm90.forward_varlen(*args, causal=causal, specialised=specialised)
    want, want_lse = cuflash.attention_varlen(*args, causal=causal, return_lse=True)
    np.testing.assert_allclose(out.get().astype(np.float64), want.get().astype(np.float64), atol=4e-3 * 5)
    np.testing.assert_allclose(lse.get(), want_lse.get(), atol=1e-3)
