"""Hypothesis strategies and input helpers shared by the CPU and GPU tests.

Shapes are drawn to hit the places kernels break: seqlen 0 and 1, primes, one past a tile
(65, 129, ...), seqlen_q != seqlen_k under causal masking, GQA ratios and odd head dims.
Every maximum is a parameter so GPU tests can draw the same kinds of shapes at larger sizes.
"""

import dataclasses

import numpy as np
from hypothesis import strategies as st

# Ragged lengths worth always trying: tiny, primes, and tile sizes plus or minus one.
SPECIAL_SEQLENS = (1, 2, 3, 5, 7, 13, 31, 63, 64, 65, 127, 128, 129, 257, 509, 1025)
SPECIAL_HEADDIMS = (1, 8, 59, 64, 111, 128, 200, 256)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool

    @property
    def q_shape(self):
        return (self.batch, self.seqlen_q, self.nheads, self.headdim)

    @property
    def kv_shape(self):
        return (self.batch, self.seqlen_k, self.nheads_kv, self.headdim)


def seqlens(max_seqlen, *, allow_zero=False):
    """A sequence length in [0 or 1, max_seqlen], often a special ragged value."""
    low = 0 if allow_zero else 1
    special = [n for n in SPECIAL_SEQLENS if n <= max_seqlen]
    if allow_zero:
        special = [0] + special
    return st.one_of(st.sampled_from(special), st.integers(low, max_seqlen))


def headdims(max_headdim, *, min_headdim=1):
    """A head dim in [min_headdim, max_headdim], often one of the awkward special sizes."""
    special = [d for d in SPECIAL_HEADDIMS if min_headdim <= d <= max_headdim] or [min_headdim]
    return st.one_of(st.sampled_from(special), st.integers(min_headdim, max_headdim))


@st.composite
def attention_shapes(
    draw,
    max_batch=2,
    max_seqlen=70,
    max_headdim=32,
    *,
    max_nheads_kv=3,
    max_group=3,
    allow_zero=False,
    headdim=None,
    causal=None,
):
    """Draw a `Shape`.

    seqlen_q and seqlen_k are drawn independently (so causal masking with seqlen_q > seqlen_k
    gives fully masked rows). `headdim` may be a strategy replacing the default head dims
    (e.g. a GPU test restricted to the head dims its kernels support); `causal` None draws
    it, a bool fixes it. `allow_zero` allows batch 0 and seqlen 0.
    """
    low = 0 if allow_zero else 1
    batch = draw(st.integers(low, max_batch))
    seqlen_q = draw(seqlens(max_seqlen, allow_zero=allow_zero))
    seqlen_k = draw(seqlens(max_seqlen, allow_zero=allow_zero))
    nheads_kv = draw(st.integers(1, max_nheads_kv))
    group = draw(st.integers(1, max_group))
    d = draw(headdims(max_headdim) if headdim is None else headdim)
    is_causal = draw(st.booleans()) if causal is None else causal
    return Shape(batch, seqlen_q, seqlen_k, nheads_kv * group, nheads_kv, d, is_causal)


def random_qkv(shape, dtype, rng, xp=np):
    """Fresh standard normal q, k, v of `shape` in `dtype` (NumPy dtype, bfloat16 included).

    `rng` is a numpy.random.Generator. With xp=cupy the numbers are drawn on the device from
    a seed taken from `rng`, so large GPU inputs never pass through the host.
    """
    if xp is np:
        def draw(size):
            return rng.standard_normal(size).astype(dtype)
    else:
        device_rng = xp.random.default_rng(int(rng.integers(2**63)))

        def draw(size):
            return device_rng.standard_normal(size, dtype=xp.float32).astype(dtype)

    return draw(shape.q_shape), draw(shape.kv_shape), draw(shape.kv_shape)


def _host_float64(x):
    if type(x).__module__.split(".")[0] == "cupy":
        x = x.get()
    return np.asarray(x).astype(np.float64)


def assert_close(actual, expected, *, atol, rtol=0.0, name="output"):
    """allclose that also demands identical NaN and ±inf positions and says where it fails.

    Takes NumPy or CuPy arrays of any float dtype and compares them in float64 on the host.

    (numpy.testing.assert_allclose treats NaN == NaN as equal by default, which would let a
    kernel that produces NaN pass against an oracle that does too.)
    """
    actual, expected = _host_float64(actual), _host_float64(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    for what, a, e in (
        ("NaN", np.isnan(actual), np.isnan(expected)),
        ("+inf", actual == np.inf, expected == np.inf),
        ("-inf", actual == -np.inf, expected == -np.inf),
    ):
        if not np.array_equal(a, e):
            where = tuple(int(i) for i in np.argwhere(a != e)[0])
            raise AssertionError(
                f"{name}: {what} mismatch at {where}: got {actual[where]}, "
                f"expected {expected[where]} ({int((a != e).sum())} positions differ)"
            )
    # NaN and inf positions agree by now; compare the finite values only.
    finite = np.isfinite(expected)
    actual, expected = np.where(finite, actual, 0.0), np.where(finite, expected, 0.0)
    error = np.abs(actual - expected)
    bad = error > atol + rtol * np.abs(expected)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{name}: max error {error.max():.3e} exceeds atol={atol:.1e}, rtol={rtol:.1e}; "
            f"first at {where}: got {actual[where]}, expected {expected[where]} "
            f"({int(bad.sum())} of {bad.size} elements)"
        )


def random_dout(shape, dtype, rng, xp=np):
    """A fresh standard normal upstream gradient shaped like the output (that is, like q).

    Drawn like random_qkv: on the host from `rng`, or on the device from a seed taken from
    `rng` when xp is cupy.
    """
    if xp is np:
        return rng.standard_normal(shape.q_shape).astype(dtype)
    device_rng = xp.random.default_rng(int(rng.integers(2**63)))
    return device_rng.standard_normal(shape.q_shape, dtype=xp.float32).astype(dtype)
