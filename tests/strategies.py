"""Hypothesis strategies and input helpers shared by the CPU and GPU tests.

Shapes are drawn to hit the places kernels break: seqlen 0 and 1, primes, one past a tile
(65, 129, ...), seqlen_q != seqlen_k under causal masking, GQA ratios and odd head dims.
Every maximum is a parameter so GPU tests can draw the same kinds of shapes at larger sizes.
The flash-attn variants (sliding windows, softcap, ALiBi, dropout) are drawn as a `Variant`,
ragged packed batches as a `VarlenShape`.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import strategies as st

# The CPU suites' warning rule: NumPy reports invalid arithmetic (such as -inf - -inf) as
# RuntimeWarning, and none may occur, except matmul's. OpenBLAS's threaded kernels may leave
# the invalid flag raised on finite operands (numpy/numpy#24067, OpenMathLib/OpenBLAS#1924:
# seen here in one run of about ten, not again on the same values); a product's NaN needs
# a NaN or inf operand, which the step that made it reports.
NO_INVALID_ARITHMETIC = [pytest.mark.filterwarnings("error::RuntimeWarning"),
                         pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")]

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


# Shared draws of the CPU tests: RNG seeds, softmax scales (None: the default; 0 is
# allowed) and the CPU path's block sizes (1, tile edges, and sizes past a tile).
seeds = st.integers(0, 2**32 - 1)
scales = st.one_of(st.none(), st.just(0.0), st.floats(0.01, 2.0))
blocks = st.one_of(st.sampled_from([1, 2, 16, 64, 65]), st.integers(1, 70))


# ALiBi slopes of the front ends' option tests, (batch 4, nheads 4).
FRONT_END_SLOPES = np.array([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.1, 0.05, 0.7],
                             [0.01, 0.2, 0.4, 0.0], [1.0, 0.5, 0.33, 0.25]], dtype=np.float32)


def front_end_variants(slopes) -> dict:
    """(causal, keywords of a front end's attention) by name: each flash-attn option alone,
    and all together. ``slopes``: FRONT_END_SLOPES as the front end's array."""
    return {
        "window": (False, dict(window_size=(5, 3))),
        "window_left_causal": (True, dict(window_size=(7, -1))),
        "window_right": (False, dict(window_size=(-1, 2))),
        "softcap": (False, dict(softcap=1.5)),
        "alibi_heads": (True, dict(alibi_slopes=slopes[0])),
        "alibi_batch_heads": (False, dict(alibi_slopes=slopes)),  # rows cut to the batch
        "dropout": (False, dict(dropout_p=0.3, seed=2**63 + 5)),  # a seed past int64: wraps in torch's rng_state
        "everything": (True, dict(window_size=(9, 0), softcap=3.0, alibi_slopes=slopes[1], dropout_p=0.2, seed=11)),
    }


def blocked_draws(shapes, **more):
    """``given`` the draws of a CPU-path test: a shape from ``shapes``, the CPU path's query
    and key block sizes, a seed (and ``more``)."""
    from hypothesis import given
    return given(shape=shapes, block_q=blocks, block_k=blocks, seed=seeds, **more)


def cpu_path_draws(shapes, **more):
    """``blocked_draws`` of a test against the oracle: also float32 or float64 and a scale."""
    return blocked_draws(shapes, dtype=st.sampled_from([np.float32, np.float64]), scale=scales, **more)


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


def numpy_options(options: dict, **extra) -> dict:
    """cuflash.attention's keywords, ALiBi slopes as a NumPy array (from a torch or JAX
    call's options on the CPU)."""
    options = {**options, **extra}
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    return options


def reference_options(options: dict, keep=None, **extra) -> dict:
    """cuflash.reference's keywords for a call's options: dropout by its keep mask, no seed."""
    ref = {name: value for name, value in numpy_options(options, **extra).items() if name != "seed"}
    ref["dropout_keep"] = keep if ref.get("dropout_p", 0) > 0 else None
    return ref


def rounding_floor(x, dtype=np.float16) -> float:
    """flash-attn's floor for low-precision comparisons: twice the largest error of storing
    a value of x's magnitude in dtype, i.e. one ulp at max|x| + 0.3 (the 0.3 keeps it above
    zero when x is all zero, as with a single key). The bound, not the storing errors of
    x's own values: with a handful of values those can all be small by chance."""
    return float(np.spacing(dtype(np.abs(x).max(initial=0.0) + 0.3)))


def random_dout(shape, dtype, rng, xp=np):
    """A fresh standard normal upstream gradient shaped like the output (that is, like q).

    Drawn like random_qkv: on the host from `rng`, or on the device from a seed taken from
    `rng` when xp is cupy.
    """
    if xp is np:
        return rng.standard_normal(shape.q_shape).astype(dtype)
    device_rng = xp.random.default_rng(int(rng.integers(2**63)))
    return device_rng.standard_normal(shape.q_shape, dtype=xp.float32).astype(dtype)


# --- the flash-attn variants ---------------------------------------------------------------


def window_sides(max_seqlen):
    """One side of a sliding window: -1 (unbounded), 0, a width up to max_seqlen, or a width
    at or beyond the sequence (which flash-attn treats as unbounded)."""
    return st.one_of(
        st.just(-1),
        st.just(0),
        st.integers(0, max(max_seqlen, 1)),
        st.integers(max_seqlen, 2 * max_seqlen + 2),
    )


def window_sizes(max_seqlen):
    """(left, right), the sides drawn independently (so often asymmetric)."""
    return st.tuples(window_sides(max_seqlen), window_sides(max_seqlen))


def softcaps(*, allow_zero=True):
    """0 (off) or a positive cap, small enough that tanh saturates for some scores."""
    caps = st.floats(0.5, 50.0)
    return st.one_of(st.just(0.0), caps) if allow_zero else caps


def dropout_ps(*, allow_zero=True):
    """0 (off) or a dropout probability in (0, 0.9)."""
    ps = st.floats(0.0, 0.9, exclude_min=True, exclude_max=True)
    return st.one_of(st.just(0.0), ps) if allow_zero else ps


@st.composite
def alibi_slopes(draw, batch, nheads, *, allow_none=True):
    """None, float32 per-head slopes (nheads,) or per-(batch, head) slopes (batch, nheads):
    either the usual geometric ALiBi slopes 2^(-8 (h + 1) / nheads) or arbitrary ones in
    [0, 1]."""
    kinds = ["head", "batch_head"] + ([None] if allow_none else [])
    kind = draw(st.sampled_from(kinds), label="alibi")
    if kind is None:
        return None
    shape = (nheads,) if kind == "head" else (batch, nheads)
    if draw(st.booleans(), label="geometric slopes"):
        slopes = 2.0 ** (-8.0 * (np.arange(nheads) + 1) / max(nheads, 1))
        return np.broadcast_to(slopes, shape).astype(np.float32)
    size = int(np.prod(shape))
    values = draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=size, max_size=size))
    return np.array(values, dtype=np.float32).reshape(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """The flash-attn options of one call; `seed` and `rng_offset` key the dropout mask."""

    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: object = None
    dropout_p: float = 0.0
    seed: int = 0
    rng_offset: int = 0

    def options(self):
        """The keywords of cuflash.cpu (and the public API): dropout keyed by seed/offset."""
        return dict(
            window_size=self.window_size,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            dropout_p=self.dropout_p,
            seed=self.seed,
            rng_offset=self.rng_offset,
        )

    def reference_options(self, dropout_keep=None):
        """The keywords of cuflash.reference: dropout by an explicit keep mask."""
        return dict(
            window_size=self.window_size,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            dropout_p=self.dropout_p,
            dropout_keep=dropout_keep if self.dropout_p > 0 else None,
        )


@st.composite
def variants(draw, batch, nheads, max_seqlen, *, window=None, softcap=None, alibi=None,
             dropout=None):
    """A `Variant` for a batch of `batch` sequences with `nheads` query heads.

    Each feature flag: None draws it (possibly off), True forces it on, False off.
    """
    def pick(flag, on, off):
        if flag is None:
            return draw(st.one_of(st.just(off), on))
        return draw(on) if flag else off

    return Variant(
        window_size=pick(window, window_sizes(max_seqlen), (-1, -1)),
        softcap=pick(softcap, softcaps(allow_zero=False), 0.0),
        alibi_slopes=pick(alibi, alibi_slopes(batch, nheads, allow_none=False), None),
        dropout_p=pick(dropout, dropout_ps(allow_zero=False), 0.0),
        seed=draw(st.integers(0, 2**64 - 1), label="seed"),
        rng_offset=draw(st.integers(0, 2**32 - 1), label="rng_offset"),
    )


@dataclasses.dataclass(frozen=True)
class VarlenShape:
    """A packed variable-length batch: q (total_q, nheads, d), k and v (total_k, nheads_kv, d)."""

    seqlens_q: tuple
    seqlens_k: tuple
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool

    @property
    def batch(self):
        return len(self.seqlens_q)

    @property
    def cu_seqlens_q(self):
        return np.concatenate([[0], np.cumsum(self.seqlens_q)]).astype(np.int32)

    @property
    def cu_seqlens_k(self):
        return np.concatenate([[0], np.cumsum(self.seqlens_k)]).astype(np.int32)

    @property
    def max_seqlen_q(self):
        return max(self.seqlens_q, default=0)

    @property
    def max_seqlen_k(self):
        return max(self.seqlens_k, default=0)

    @property
    def q_shape(self):
        return (sum(self.seqlens_q), self.nheads, self.headdim)

    @property
    def kv_shape(self):
        return (sum(self.seqlens_k), self.nheads_kv, self.headdim)


@st.composite
def varlen_shapes(draw, max_batch=4, max_seqlen=40, max_headdim=32, *, max_nheads_kv=2,
                  max_group=3, headdim=None, causal=None):
    """Draw a `VarlenShape`: 1..max_batch sequences, each with its own seqlen_q and seqlen_k
    (often equal, zero allowed in either), GQA, causal drawn unless fixed. random_qkv and
    random_dout accept it like a `Shape`."""
    batch = draw(st.integers(1, max_batch))
    lengths = seqlens(max_seqlen, allow_zero=True)
    seqlens_q = tuple(draw(st.lists(lengths, min_size=batch, max_size=batch), label="seqlens_q"))
    if draw(st.booleans(), label="same k lengths"):
        seqlens_k = seqlens_q
    else:
        seqlens_k = tuple(draw(st.lists(lengths, min_size=batch, max_size=batch), label="seqlens_k"))
    nheads_kv = draw(st.integers(1, max_nheads_kv))
    group = draw(st.integers(1, max_group))
    d = draw(headdims(max_headdim) if headdim is None else headdim)
    is_causal = draw(st.booleans()) if causal is None else causal
    return VarlenShape(seqlens_q, seqlens_k, nheads_kv * group, nheads_kv, d, is_causal)


class Launches:
    """Records the pointers and stream of every kernel launch (zero-copy checks)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from cuflash import experiment
        self._observing = experiment.observe_launches(lambda pointers, stream: self.calls.append((pointers, stream)))
        self._observing.__enter__()
        return self

    def __exit__(self, *exc):
        return self._observing.__exit__(*exc)


@st.composite
def kvcache_calls(draw, paged: bool = False, max_capacity: int = 24, headdims=(4, 8, 12)):
    """The sizes and options of a KV-cache call (``attention_with_kvcache``), as a dict:
    GQA/MQA, seqlen_q 1-5 with 0, 1, seqlen_q or seqlen_q + 2 new keys, lengths from 0 to full, left
    padding, cache_batch_idx, rotary of every width and both layouts, causal, drawn windows,
    softcap, ALiBi; with ``paged``, a page size (1, 3, 16, 17, ...) instead of batch_idx. The
    CPU suites keep the defaults (one tile); the GPU's pass capacities and head dims that
    cross tiles and splits."""
    batch = draw(st.integers(1, 3))
    nheads_k = draw(st.sampled_from([1, 2]))
    nheads = nheads_k * draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from(headdims))
    seqlen_q = draw(st.integers(1, 5))
    seqlen_new = draw(st.sampled_from([0, 1, seqlen_q, seqlen_q + 2]))
    capacity = draw(st.one_of(st.integers(max(seqlen_new, 1), max_capacity), st.just(max_capacity)))
    lengths = [draw(st.integers(0, capacity - seqlen_new)) for _ in range(batch)]
    leftpads = [draw(st.integers(0, n)) if draw(st.booleans()) else 0 for n in lengths]
    rotary_dim = draw(st.sampled_from([0, 2, d // 2 * 2 if d % 4 == 0 else 2, d // 2 * 2])) if seqlen_new else 0
    page_size = draw(st.sampled_from([1, 3, 5, 16, 17])) if paged else 0
    # (small sides too: one at least a sequence's keys but below the capacity still bounds the mask)
    small = st.sampled_from([-1, 0, 1, 2, 3])
    window = draw(st.one_of(st.just((-1, -1)), window_sizes(capacity), st.tuples(small, small)), label="window")
    return dict(batch=batch, nheads=nheads, nheads_k=nheads_k, d=d, seqlen_q=seqlen_q, seqlen_new=seqlen_new,
                capacity=capacity, lengths=lengths, leftpads=leftpads, rotary_dim=rotary_dim,
                interleaved=draw(st.booleans()), causal=draw(st.booleans()), window=window,
                softcap=draw(st.sampled_from([0.0, 2.0])), alibi=draw(st.booleans()),
                batch_idx=not paged and draw(st.booleans()), page_size=page_size,
                seed=draw(st.integers(0, 2**32 - 1)))


def paged_caches(rng, batch, capacity, page_size, nheads_k, d, dtype, spare=3):
    """(block_table, k_pages, v_pages, k_dense, v_dense): random pages, ``spare`` more than
    the sequences use, handed out in shuffled order, and the contiguous caches they hold."""
    per_seq = -(-capacity // page_size)
    pages = batch * per_seq + spare
    table = rng.permutation(pages)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    k_pages, v_pages = (rng.standard_normal((pages, page_size, nheads_k, d)).astype(dtype) for _ in "kv")
    k_dense, v_dense = (x[table].reshape(batch, -1, nheads_k, d)[:, :capacity].copy() for x in (k_pages, v_pages))
    return table, k_pages, v_pages, k_dense, v_dense


def check_paged_is_bitwise_contiguous(xp, page_size, capacity, nheads, nheads_k, d, batch=2, **options) -> None:
    """One KV-cache call over paged caches and over the contiguous caches they hold, with
    an append (rotary, causal) to empty and to almost full sequences (``batch`` even), on
    ``xp``'s arrays (NumPy or CuPy): the same output and LSE bits, the same cache rows
    written."""
    import cuflash
    rng = np.random.default_rng(page_size)
    table, k_pages, v_pages, k_dense, v_dense = paged_caches(rng, batch, capacity, page_size, nheads_k, d, np.float16)
    q = rng.standard_normal((batch, 3, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((batch, 3, nheads_k, d)).astype(np.float16) for _ in "kv")
    angle = rng.uniform(0, 6, (capacity + 3, d // 4))
    kw = dict(cache_seqlens=xp.asarray(np.array([0, capacity - 3] * (batch // 2), np.int32)),
              rotary_cos=xp.asarray(np.cos(angle).astype(np.float16)),
              rotary_sin=xp.asarray(np.sin(angle).astype(np.float16)), causal=True, return_lse=True, **options)
    q, k, v, k_dense, v_dense, k_pages, v_pages, table = (
        xp.asarray(x) for x in (q, k, v, k_dense, v_dense, k_pages, v_pages, table))
    dense = cuflash.attention_with_kvcache(q, k_dense, v_dense, k, v, **kw)
    paged = cuflash.attention_with_kvcache(q, k_pages, v_pages, k, v, block_table=table, **kw)
    assert (dense[0] == paged[0]).all() and (dense[1] == paged[1]).all()
    for pool, cache in ((k_pages, k_dense), (v_pages, v_dense)):
        assert (pool[table].reshape(batch, -1, nheads_k, d)[:, :capacity] == cache).all()


def assert_lse_close(got, want, atol: float) -> None:
    """LSEs equal where infinite (a row that sees no key), within atol elsewhere."""
    assert (np.isposinf(got) == np.isposinf(want)).all() and (np.isneginf(got) == np.isneginf(want)).all()
    assert_close(np.where(np.isinf(got), 0, got), np.where(np.isinf(want), 0, want), atol=atol, name="lse")


def finite_difference(f, x, step=1e-6):
    """Central differences of the scalar f() in every element of x, which f reads in place."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + step
        above = f()
        x[index] = saved - step
        below = f()
        x[index] = saved
        grad[index] = (above - below) / (2 * step)
    return grad


def assert_nan_row(out, lse, row) -> None:
    """out (batch, seqlen, nheads, d) is NaN in all of row (b, i, h) and nowhere else, and lse
    (batch, nheads, seqlen) NaN in that row only."""
    nan_rows = np.zeros(out.shape[:-1], dtype=bool)
    nan_rows[row] = True
    assert np.isnan(out).all(axis=-1).tolist() == nan_rows.tolist()
    assert not np.isnan(out[~nan_rows]).any()
    assert np.isnan(lse).tolist() == nan_rows.transpose(0, 2, 1).tolist()


def record_calls(monkeypatch, owner, name: str) -> list:
    """Replace owner.name by a wrapper that appends each result to the returned list."""
    results = []
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(owner, name, wrapper)
    return results
