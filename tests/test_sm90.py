"""The sm_90a forward (cuda/sm90/fwd.cu): every instance compiles for sm_90a with no spill
and no ptxas C75xx warning (setmaxnreg ignored, wgmma serialised); the planner sends it
the calls it takes and no other; on a Hopper GPU its output and LSE, and the mma.sync
kernels' (CUFLASH_PORTABLE=1) on the same calls, match the float64 oracle by flash-attn's
rule (tests/rule.py), in NaN-poisoned memory, score_mod / mask_mod and block masks
included. The forward and variant suites run on both families too (the forward_family
fixture)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _arrays, _compile, _device, _kernels, _options, _plan, _sass, api, experiment, mod
from cuflash._params import Sm90ModParams, Sm90Params
from cuflash.reference import attention_lowp, attention_reference

from .conftest import hopper
from .rule import check_attention, check_lse, check_output, lowp_error, tile_marked
from .strategies import record_calls
from .test_plan import device, info


def _compiled_sample(kernel) -> bool:
    """Every d 128 forward, each other head dim's forward with all its branches (compile-all
    builds the rest), and every backward."""
    if isinstance(kernel, (_plan.Sm90Backward, _plan.Sm90WideBackward)):
        return True
    return kernel.head_dim == 128 or kernel.local and kernel.extras


@pytest.mark.parametrize("kernel", [k for k in _plan.all_kernels("sm_90a") if _compiled_sample(k)],
                         ids=lambda k: k.instance)
def test_sm90a_instances_compile_clean(kernel):
    """compile_kernel refuses a ptxas C75xx warning: setmaxnreg ignored, wgmma serialised.
    Where nvdisasm is at hand (the test extra, on Linux), the forward's machine code keeps
    the softmax ahead of P V's wait (cuflash/_sass.py): ptxas moves that wait up
    unless sm90::keep_before_wait holds it, a loss no output would show."""
    compiled = _compile.run_nvrtc(kernel.source, kernel.instance, ("--gpu-architecture=sm_90a", *_compile.OPTIONS))
    resources = compiled.resources
    assert resources.spill_stores == 0 and resources.stack_bytes == 0, resources
    if isinstance(kernel, (_plan.Sm90Backward, _plan.Sm90WideBackward)):
        return
    nvdisasm = _sass.find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("no nvdisasm (the test extra's nvidia-cuda-nvdisasm, Linux only): the schedule is not checked")
    if _sass.keeps_softmax_beside_values(kernel):
        sass = _sass.disassemble(compiled.cubin, nvdisasm)
        assert _sass.overlapped(sass, kernel), \
            f"{_sass.exponentials_between_waits(sass)} exp2 ahead of P V's wait, {kernel.block_n // 2} expected"


def _plan_of(q, k, v, sm90a=True, **options):
    """The forward's plan for NumPy stand-ins of these shapes (no GPU needed)."""
    infos = [_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v))]
    made = _options.make_options(infos[0], infos[1], options.get("causal", False), None,
                                 options.get("window_size", (-1, -1)), 0.0, None, 0.0, None, 0, backward=False)
    out = _arrays.inspect(np.empty_like(q), "out")
    return _plan.forward(*infos, out, made, None, device(sm90a=sm90a))


def test_the_planner_sends_the_sm90_forward_what_it_takes():
    def qkv(seqlen, d=128, dtype=np.float16):
        return [np.zeros((2, seqlen, 4, d), dtype) for _ in range(3)]

    def kernel(*args, **kw):
        return _plan_of(*args, **kw).steps[0].kernel

    assert isinstance(kernel(*qkv(1000)), _plan.Sm90Forward)
    assert _plan_of(*qkv(1000)).struct is Sm90Params
    assert [m.field for m in _plan_of(*qkv(1000)).maps] == ["q", "k", "v"]
    assert isinstance(kernel(*qkv(1000), causal=True), _plan.Sm90Forward)
    assert [kernel(*qkv(1000, d=d)).head_dim for d in (64, 96, 128, 136, 192, 200, 256)] == \
        [64, 128, 128, 192, 192, 256, 256]
    # d 64: three consumers, 192 query rows; d 128: 176 keys, 128 under a causal mask
    plans = _plan_of(*qkv(1000, d=64)), _plan_of(*qkv(1000)), _plan_of(*qkv(1000), causal=True)
    assert [(p.steps[0].kernel.threads, [m.rows for m in p.maps]) for p in plans] == \
        [(512, [192, 128, 128]), (384, [128, 176, 176]), (384, [128, 128, 128])]
    assert [(p.steps[0].kernel.block_n, p.steps[0].kernel.stages) for p in plans[1:]] == [(176, 2), (128, 3)]
    # d 64 causal below SM90_SHORT_CAUSAL_ROWS query rows: two consumers (more, shorter tiles)
    rows = _plan.SM90_SHORT_CAUSAL_ROWS
    assert [kernel(*qkv(n, d=64), causal=True).consumers for n in (1000, rows - 1, rows)] == [2, 2, 3]
    assert kernel(*qkv(1000, d=64), window_size=(100, 0)).consumers == 3
    assert isinstance(kernel(*qkv(1000, d=32)), _plan.Kernel)         # below 64: the mma.sync kernels
    assert isinstance(kernel(*qkv(1000), sm90a=False), _plan.Kernel)  # other GPUs, or CUFLASH_PORTABLE
    q, k, v = qkv(1000)
    assert isinstance(kernel(q, k[:, :, :2], v[:, :, :2]), _plan.Sm90Forward)       # GQA
    strided = np.zeros((2, 1000, 4, 130), np.float16)[..., :128]                 # rows of 260 bytes
    assert isinstance(kernel(strided, k, v), _plan.Kernel)
    assert isinstance(kernel(q, k[:, :0], v[:, :0]), _plan.Kernel)                # no keys


def test_the_scheduler_interleaves_as_many_heads_as_fit_in_l2_under_a_causal_mask():
    """Under a causal mask, from SM90_SECTION_ROWS query rows, the longest tiles of a section
    of (head, sequence) pairs go first (fwd.cu, Sm90Tiles): at most as many pairs as keep
    their K and V within SM90_SECTION_BYTES, whole groups of heads sharing keys, in sections
    of equal size; otherwise one."""
    budget, rows = _plan.SM90_SECTION_BYTES, _plan.SM90_SECTION_ROWS
    causal = (-1, 0)
    assert _plan.sm90_section((-1, -1), 8192, 8192, 128, 1, 64) == 1
    assert _plan.sm90_section(causal, 8192, 8192, 128, 1, 64) == budget // (4 * 8192 * 128)
    assert _plan.sm90_section(causal, 8192, 8192, 128, 4, 64) == 4 * (budget // (4 * 8192 * 128))  # GQA groups
    assert _plan.sm90_section(causal, rows, 1024, 64, 1, 20) == 20                                # all of them
    assert _plan.sm90_section(causal, rows, 1 << 20, 256, 2, 64) == 2             # one kv head's group at least
    assert _plan.sm90_section(causal, rows - 1, 8192, 128, 1, 64) == 1            # short calls: pair after pair
    assert _plan.sm90_section(causal, 8192, 8192, 128, 3, 18) == 9                # 12 at most: 2 sections of 9
    assert _plan.sm90_section((-1, 7), 8192, 8192, 128, 1, 64) > 1                # keys growing with the block
    assert _plan.sm90_section((100, 0), 8192, 8192, 128, 1, 64) == 1              # a window: tiles alike
    section = lambda *a, **kw: Sm90Params.from_buffer_copy(_plan_of(*a, **kw).params).section
    qkv = [np.zeros((2, 8192, 16, 128), np.float16) for _ in range(3)]
    assert section(*qkv) == 1 and section(*qkv, window_size=(64, 0)) == 1
    assert section(*qkv, causal=True) == budget // (4 * 8192 * 128)
    # A block mask's tiles in a causal mask's order (a lower-triangular mask's longest first)
    infos = [_arrays.inspect(x, name) for name, x in zip(("q", "k", "v"), qkv)]
    made = _options.make_options(infos[0], infos[1], False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    mask_only = "struct UserMods { static constexpr bool kScore = false, kMask = true, kBlocks = true; };"
    mods = _options.DeviceMods(mask_only, (), info((1, 1, 64, 64), "int8", 4096))
    blocked = _plan.forward(*infos, infos[0], made._replace(mods=mods), None, device(sm90a=True))
    assert Sm90ModParams.from_buffer_copy(blocked.params).section == budget // (4 * 8192 * 128)


class TailModel:
    """sm90/tile_scheduler.cuh's unmasked scheduler, line for line (C's integer division
    of non-negative ints is Python's //): each CTA's works from first() through next()
    to end, each work's tile, turns and piece."""

    def __init__(self, tiles: int, key_tiles: int, grid: int, tail_start: int, tail_ctas: int):
        self.count, self.key_tiles, self.grid = tiles, key_tiles, grid
        self.start, self.ctas = tail_start, tail_ctas
        self.units = (tiles - tail_start) * key_tiles
        self.end = tiles + self.units

    def unit_start(self, c):
        return c * self.units // self.ctas

    def cta_of(self, u):
        return ((u + 1) * self.ctas - 1) // self.units

    def tail_of(self, c):
        if c < self.ctas and self.unit_start(c) < self.unit_start(c + 1):
            return self.count + self.unit_start(c)
        return self.count + self.units

    def first(self, c):
        return c if c < self.start else self.tail_of(c)

    def next(self, t, c):
        if t + self.grid < self.start:
            return t + self.grid
        if t < self.start:
            return self.tail_of(c)
        u = t - self.count
        share_end = self.unit_start(self.cta_of(u) + 1)
        piece_end = min(share_end, (u // self.key_tiles + 1) * self.key_tiles)
        return self.count + (piece_end if piece_end < share_end else self.units)

    def piece(self, i, c):
        n = self.key_tiles
        begin, end = max(self.unit_start(c), i * n), min(self.unit_start(c + 1), (i + 1) * n)
        first, last = self.cta_of(i * n), self.cta_of((i + 1) * n - 1)
        return dict(tile=self.start + i, turns=(begin - i * n, end - i * n), pieces=last - first + 1, tail_tile=i,
                    slot=i + c, first_slot=i + first)

    def work(self, t):
        if t < self.count:
            return dict(tile=t, turns=(0, self.key_tiles), pieces=1)
        u = t - self.count
        return self.piece(u // self.key_tiles, self.cta_of(u))

    def works(self, c):
        t = self.first(c)
        while t < self.end:
            yield self.work(t)
            t = self.next(t, c)


@settings(max_examples=400, deadline=None)
@given(tiles=st.integers(1, 3000), key_tiles=st.integers(1, 2000), multiprocessors=st.sampled_from([1, 7, 114, 132]))
def test_the_tail_is_cut_into_pieces_that_cover_every_key_tile_once(tiles, key_tiles, multiprocessors):
    """The unmasked scheduler with the planner's cut (_plan.sm90_tail): whole tiles before
    the tail, each once; each tail tile's turns covered once, by pieces numbered 0 ..
    pieces - 1 in turn order, each in its own workspace slot, the tile's first piece's slot
    its first_slot; the merging CTA finds its piece again from the tile alone (piece_of);
    every tail CTA one piece of one tile, as many pieces for every tile (2 to
    SM90_TAIL_MAX_PIECES, of SM90_TAIL_MIN_TURNS turns or more), each with its own costs
    (SM90_TAIL_PIECE_TURNS) shorter than a tile."""
    start, ctas = _plan.sm90_tail(tiles, key_tiles, multiprocessors)
    grid = max(min(tiles, multiprocessors), ctas)
    model = TailModel(tiles, key_tiles, grid, start, ctas)
    whole, pieces, shares = [], {}, []
    for c in range(grid):
        share, works = 0, 0
        for work in model.works(c):
            if work["tile"] < start:
                whole.append(work["tile"])
                continue
            lo, hi = work["turns"]
            assert 0 <= lo < hi <= key_tiles
            assert work == model.piece(work["tile"] - start, c)
            pieces.setdefault(work["tile"], []).append(work)
            share, works = share + hi - lo, works + 1
        if c < ctas:
            shares.append(share)
            assert works == 1
    assert sorted(whole) == list(range(start))
    assert sorted(pieces) == list(range(start, tiles if ctas else start))
    slots = [w["slot"] for ws in pieces.values() for w in ws]
    assert len(set(slots)) == len(slots) and all(0 <= s < tiles - start + ctas - 1 for s in slots)
    for tile, ws in pieces.items():
        ws.sort(key=lambda w: w["turns"])
        assert [w["turns"][0] for w in ws] == [0] + [w["turns"][1] for w in ws[:-1]] and ws[-1]["turns"][1] == key_tiles
        assert [w["slot"] - w["first_slot"] for w in ws] == list(range(len(ws))) and {w["pieces"] for w in ws} == {len(ws)}
        assert len(ws) <= _plan.SM90_TAIL_MAX_PIECES
    if ctas:
        assert {len(ws) for ws in pieces.values()} == {ctas // (tiles - start)} and ctas // (tiles - start) >= 2
        assert min(shares) >= _plan.SM90_TAIL_MIN_TURNS and model.units * ctas < 2 ** 31
        assert max(shares) + _plan.SM90_TAIL_PIECE_TURNS < key_tiles


def test_the_plan_cuts_the_tail_of_unmasked_dense_calls():
    """A cut adds the pieces' workspace (a slot per piece, an arrival counter per tail tile
    and consumer warp, zeroed at launch) and takes as many CTAs as share the tail; causal,
    windowed and packed calls are not cut."""
    q = np.zeros((1, 1000, 4, 128), np.float16)
    k = v = np.zeros((1, 4000, 2, 128), np.float16)
    infos = [_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v), ("out", q))]

    def plan(window=(-1, -1)):
        options = _options.make_options(infos[0], infos[1], False, None, window, 0.0, None, 0.0, None, 0,
                                        backward=False)
        return _plan.forward(*infos, options, None, device(multiprocessors=132, sm90a=True))

    cut, banded = plan(), plan((-1, 0))
    params = Sm90Params.from_buffer_copy(cut.params)
    tiles, key_tiles = 8 * 4, -(-4000 // 176)  # 128-row tiles; 176 keys each: 32 tiles in 4 pieces
    assert (params.tail_start, params.tail_key_tiles) == (0, key_tiles) and params.tail_ctas == 128
    assert _plan.sm90_tail(tiles, key_tiles, 132) == (0, 128)
    assert cut.steps[0].grid[0] == 128 and cut.counters == ("arrivals",)
    slots = tiles + 128 - 1
    assert cut.workspace == (("partial_o", (slots, 128, 128), "float32"), ("partial_lse", (slots, 128), "float32"),
                             ("arrivals", (tiles, 8), "int32"))
    assert cut.pointers[-3:] == ("partial_o", "partial_lse", "arrivals")
    banded_params = Sm90Params.from_buffer_copy(banded.params)
    assert banded.counters == ("tile_counter",) and banded_params.tail_ctas == 0
    assert _plan.sm90_tail(264, 50, 132) == (264, 0)     # a full last wave
    assert _plan.sm90_tail(140, 3, 132) == (140, 0)      # too few turns to share
    assert _plan.sm90_tail(200, 50, 132) == (200, 0)     # 68 of 132 CTAs busy: not two pieces a tile
    assert _plan.sm90_tail(160, 23, 132) == (132, 112)   # 28 tiles in 4 pieces
    assert _plan.sm90_tail(200, 0, 132) == (200, 0)


def test_tensor_maps_are_encoded_once_per_array(monkeypatch):
    """A map depends on its arguments alone: the driver encodes each (address, shape,
    strides, box) once."""
    from cuflash import _tensormap
    calls = []

    def fake_encode(result, dtype, rank, pointer, dims, strides, box, steps, *flags):
        calls.append(pointer.value)
        result._obj.v[0] = pointer.value
        return 0

    monkeypatch.setattr(_tensormap, "encode_function", lambda: fake_encode)
    _tensormap.encode.cache_clear()
    try:
        args = ("bfloat16", (2, 1000, 4, 128), (512000, 512, 128, 1), 128)
        first, again, other = (_tensormap.encode(ptr, *args) for ptr in (1 << 20, 1 << 20, 2 << 20))
        assert calls == [1 << 20, 2 << 20] and first is again and other.v[0] == 2 << 20
    finally:
        _tensormap.encode.cache_clear()


@pytest.fixture
def paths(monkeypatch):
    """run(portable, fn): fn() on the sm_90a path (asserting that every forward it plans
    takes it) or on the mma.sync kernels, with fresh plans either way."""
    planned = record_calls(monkeypatch, _plan, "forward")

    def forget_plans():
        _kernels._launchers.clear()
        api._warm.clear()

    def run(portable: bool, fn):
        monkeypatch.setenv("CUFLASH_PORTABLE", "1" if portable else "0")
        forget_plans()
        planned.clear()
        result = fn()
        assert planned and all((p.struct in (Sm90Params, Sm90ModParams)) != portable for p in planned if p.steps)
        return result

    yield run
    forget_plans()


def _arrays_of(rng, dtype, *shapes):
    import cupy

    from .test_gpu_forward import cupy_dtype
    host = [rng.standard_normal(s).astype(cupy_dtype(dtype)) for s in shapes]
    return host, [cupy.asarray(x) for x in host]


def _both_paths(paths, call):
    """call() on the sm_90a path and on the mma.sync kernels, into poisoned memory."""
    from .test_gpu_forward import poisoned_allocations
    with poisoned_allocations():
        return paths(False, call), paths(True, call)


SHAPES = [(1, 128, 128, 1, 1), (2, 1, 300, 4, 2), (1, 129, 257, 2, 2), (2, 300, 517, 4, 1), (1, 1000, 1000, 2, 2),
          (1, 2048, 2048, 4, 4), (1, 700, 5, 2, 1)]
# d 128 with every shape in both dtypes; the other head dims (the kernels of 64, 192 and 256,
# and 96, 160 and 232 on the copy engine's zero columns) with four shapes in one dtype each.
CASES = [(128, dtype, *shape) for dtype in ("float16", "bfloat16") for shape in SHAPES] + \
        [(d, dtype, *shape) for d, dtype in ((64, "bfloat16"), (96, "float16"), (160, "float16"), (192, "bfloat16"),
                                             (232, "bfloat16"), (256, "float16"))
         for shape in SHAPES[1:5]]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim,dtype,batch,seqlen_q,seqlen_k,heads,heads_k", CASES)
@pytest.mark.parametrize("causal,window_size,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                    (False, (200, 30), 0.0), (True, (-1, -1), 20.0)])
def test_both_forward_families_match_the_oracle(paths, head_dim, dtype, batch, seqlen_q, seqlen_k, heads, heads_k,
                                                causal, window_size, softcap):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k)
    _, (q, k, v) = _arrays_of(rng, dtype, (batch, seqlen_q, heads, head_dim), (batch, seqlen_k, heads_k, head_dim),
                              (batch, seqlen_k, heads_k, head_dim))
    options = dict(causal=causal, window_size=window_size, softcap=softcap)
    for out, lse in _both_paths(paths, lambda: cuflash.attention(q, k, v, return_lse=True, **options)):
        check_attention(q, k, v, out, lse, **options)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_alibi_and_dropout_on_both_families(paths, causal, dtype):
    """ALiBi, dropout (the oracle applies the keep mask cuflash._philox makes for the seed)
    and ALiBi with softcap, on each path against the oracle."""
    import cupy

    from .test_gpu_variants import check_forward
    rng = np.random.default_rng(5)
    _, (q, k, v) = _arrays_of(rng, dtype, (2, 333, 4, 128), (2, 517, 2, 128), (2, 517, 2, 128))
    slopes = cupy.asarray(rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32))
    for options in (dict(alibi_slopes=slopes), dict(dropout_p=0.2, seed=11), dict(alibi_slopes=slopes, softcap=5.0)):
        options = dict(options, causal=causal)
        for out, lse in _both_paths(paths, lambda: cuflash.attention(q, k, v, return_lse=True, **options)):
            check_forward(q, k, v, out, lse, options)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_the_varlen_forward_on_both_families(paths, causal):
    """Packed sequences of ragged lengths (1, a tile + 1, primes, an empty one), out in
    poisoned memory: no row written outside its sequence, none left unwritten."""
    import cupy

    from .test_gpu_variants import check_forward
    rng = np.random.default_rng(3)
    lengths_q, lengths_k = np.array([1, 129, 211, 0, 64, 997]), np.array([300, 129, 17, 5, 640, 1000])
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    _, (q, k, v) = _arrays_of(rng, "float16", (lengths_q.sum(), 4, 128), (lengths_k.sum(), 2, 128),
                              (lengths_k.sum(), 2, 128))
    args = (q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()))
    for out, lse in _both_paths(paths, lambda: cuflash.attention_varlen(*args, causal=causal, return_lse=True)):
        check_forward(q, k, v, out, lse, dict(causal=causal), varlen=(cu_q, cu_k))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kv_heads_a_section", [1, 2, 1000])
@pytest.mark.parametrize("window_size", [(-1, 0), (-1, 7)])
def test_every_tile_is_computed_once_whatever_the_section(paths, monkeypatch, kv_heads_a_section, window_size):
    """The scheduler's sections (a section's worth of K and V forced to 1 or 2 kv heads, or
    all of them; 15 pairs of 3 sequences x 5 heads on one kv head: sections of 5, 8 + 7 and
    15 pairs) reorder the tiles: into poisoned memory, every row still written, by its own
    tile, dense and packed."""
    import cupy

    from .test_gpu_forward import poisoned_allocations
    from .test_gpu_variants import check_forward
    seqlen = 300
    monkeypatch.setattr(_plan.sm90, "SM90_SECTION_BYTES", kv_heads_a_section * 4 * seqlen * 128)
    monkeypatch.setattr(_plan.sm90, "SM90_SECTION_ROWS", 1)
    rng = np.random.default_rng(kv_heads_a_section)
    _, (q, k, v) = _arrays_of(rng, "bfloat16", (3, seqlen, 5, 128), (3, seqlen, 1, 128), (3, seqlen, 1, 128))
    cu = cupy.arange(0, 3 * seqlen + 1, seqlen, dtype=np.int32)
    packed_qkv = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    with poisoned_allocations():
        out, lse = paths(False, lambda: cuflash.attention(q, k, v, window_size=window_size, return_lse=True))
        packed = paths(False, lambda: cuflash.attention_varlen(*packed_qkv, cu, cu, seqlen, seqlen,
                                                               window_size=window_size, return_lse=True))
    check_attention(q, k, v, out, lse, window_size=window_size)
    check_forward(*packed_qkv, *packed, dict(window_size=window_size), varlen=(cu, cu))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("ctas", [1, 5, 1000])
@pytest.mark.parametrize("window_size", [(-1, 0), (40, 40)])
def test_a_banded_grid_takes_every_tile_once_from_its_counter(ctas, window_size):
    """Under a causal mask or a window the CTAs take tiles from a counter that the launcher
    zeroes for each launch: with 1 or 5 CTAs for 36 tiles, or a CTA a tile, three launches
    in a row into poisoned memory (the counter too), every row written by its own tile; a
    launch without the counter is refused."""
    import cupy
    rng = np.random.default_rng(ctas)
    _, (q, k, v) = _arrays_of(rng, "bfloat16", (2, 700, 3, 128), (2, 700, 1, 128), (2, 700, 1, 128))
    infos = [_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v), ("out", q))]
    options = _options.make_options(infos[0], infos[1], False, None, window_size, 0.0, None, 0.0, None, 0,
                                    backward=False)
    plan = _plan.forward(*infos, options, None, device(multiprocessors=ctas, sm90a=True))
    assert plan.steps[0].grid[0] == min(ctas, 36) and plan.counters == ("tile_counter",)
    launcher = _kernels.Launcher(plan, 0)
    stream = cupy.cuda.get_current_stream().ptr
    for _ in range(3):
        out, lse, counter = cupy.empty_like(q), cupy.empty((2, 3, 700), np.float32), cupy.empty(1, np.int32)
        for x in (out, lse, counter):
            x.view(np.uint8).fill(0xFF)
        launcher(stream, *(x.data.ptr for x in (q, k, v, out, lse, counter)))
        check_attention(q, k, v, out, lse, window_size=window_size)
    with pytest.raises(ValueError, match="workspace"):
        launcher(stream, *(x.data.ptr for x in (q, k, v, out, lse)))


@pytest.mark.gpu
@hopper
def test_torch_reaches_the_sm90_forward_and_its_backward_takes_the_lse(paths):
    """Through torch autograd on both paths: out and the gradients against the oracle."""
    torch = pytest.importorskip("torch", reason="the torch front end needs PyTorch")
    import cupy

    import cuflash.torch

    from cuflash.reference import attention_lowp, attention_reference

    from .test_gpu_backward import check_gradients
    q, k, v = (torch.randn(2, 600, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def run():
        out = cuflash.torch.attention(q, k, v, causal=True)
        out.float().square().sum().backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        return out.detach(), grads

    arrays = [cupy.from_dlpack(x.detach()) for x in (q, k, v)]
    ref, _ = attention_reference(*arrays, causal=True)
    yardstick = lowp_error(attention_lowp(*arrays, causal=True), ref)
    for portable in (False, True):
        out, grads = paths(portable, run)
        check_output(cupy.from_dlpack(out), ref, yardstick, "bfloat16")
        dout = cupy.from_dlpack((2 * out.float()).to(torch.bfloat16))  # (of the loss: sum of out squared)
        check_gradients(dout, *arrays, [cupy.from_dlpack(g) for g in grads], causal=True)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_the_sm90_forward_is_bitwise_reproducible(paths, causal):
    """One order of key tiles per row, whichever CTA takes the tile (the banded grid's
    counter decides only that): the same call, the same bits (the deterministic mode's
    promise holds for the forward on either path)."""
    rng = np.random.default_rng(9)
    _, (q, k, v) = _arrays_of(rng, "bfloat16", (2, 1000, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128))
    first, first_lse = paths(False, lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
    again, again_lse = paths(False, lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
    assert (first.view(np.uint16) == again.view(np.uint16)).all() and (first_lse == again_lse).all()


# Unmasked calls whose last wave the planner cuts along the keys (on 114 or 132
# multiprocessors): fewer tiles than multiprocessors with many keys each (every tile cut,
# up to thirteen pieces), and a wave and a bit (whole tiles, then the cut tail); d 96 rides
# on d 128's kernel with zero columns.
TAIL_CASES = [(128, "bfloat16", 1, 1000, 4001, 4, 2), (128, "float16", 2, 1000, 4000, 10, 1),
              (64, "bfloat16", 1, 700, 5003, 3, 3), (256, "float16", 1, 300, 3001, 2, 1),
              (192, "bfloat16", 1, 300, 3001, 2, 1),
              (96, "float16", 1, 129, 9000, 1, 1)]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim,dtype,batch,seqlen_q,seqlen_k,heads,heads_k", TAIL_CASES)
@pytest.mark.parametrize("extras", ["", "softcap", "alibi", "dropout", "marked"])
def test_a_cut_tail_matches_the_oracle_on_both_families(paths, head_dim, dtype, batch, seqlen_q, seqlen_k, heads,
                                                        heads_k, extras):
    """Each piece's O and LSE merged by the last to finish: into poisoned memory every row
    written, as the oracle has it (dropout's keep mask cuflash._philox's), LSE included,
    the same bits call after call; the mma.sync kernels on the same calls. "marked":
    inputs on which a lost key tile or piece fails the rule (tests/rule.py)."""
    import cupy

    from .test_gpu_forward import cupy_dtype, poisoned_allocations
    from .test_gpu_variants import check_forward
    with_extras = extras not in ("", "marked")
    kernel = _plan.Sm90Forward.of(dtype, next(d for d in _plan.SM90_HEAD_DIMS if d >= head_dim), False, with_extras)
    tiles = -(-seqlen_q // kernel.block_m) * heads * batch
    assert _plan.sm90_tail(tiles, -(-seqlen_k // kernel.block_n), _device.facts(0).multiprocessors)[1], "not cut"
    rng = np.random.default_rng(seqlen_k + head_dim)
    if extras == "marked":
        q, k, v = tile_marked(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, cupy_dtype(dtype), rng, xp=cupy)
    else:
        _, (q, k, v) = _arrays_of(rng, dtype, (batch, seqlen_q, heads, head_dim),
                                  (batch, seqlen_k, heads_k, head_dim), (batch, seqlen_k, heads_k, head_dim))
    options = {"softcap": dict(softcap=5.0), "dropout": dict(dropout_p=0.2, seed=3),
               "alibi": dict(alibi_slopes=cupy.asarray(rng.uniform(0.01, 0.2, (batch, heads)).astype(np.float32)))}
    options = options.get(extras, {})
    with poisoned_allocations():
        again, again_lse = paths(False, lambda: cuflash.attention(q, k, v, return_lse=True, **options))
    results = _both_paths(paths, lambda: cuflash.attention(q, k, v, return_lse=True, **options))
    for out, lse in results:
        check_forward(q, k, v, out, lse, options)
    out, lse = results[0]
    assert (out.view(np.uint16) == again.view(np.uint16)).all() and (lse == again_lse).all()


MODS_TILES = {64: (64, 4, 2), 128: (64, 3, 2)}  # (the sm_90a forward's tiles for mods, where it takes them)


def test_mods_take_the_sm90_forward_only_where_its_mods_table_says():
    """By default calls with mods on the extras' instance (score_mod, or mask_mod without a
    block mask) keep the mma.sync forward (SM90_MODS_TILES is empty); where the table names
    the head dim (experiment.override): two consumers, 64
    keys a tile (a tile inside one of a block mask's blocks), no tail cut, the mod tensors
    after Params."""
    def plan(d, blocks=False, causal=False):
        infos = [_arrays.inspect(np.zeros((2, 1000, 4, d), np.float16), name) for name in ("q", "k", "v")]
        made = _options.make_options(infos[0], infos[1], causal, None, (-1, -1), 0.0, None, 0.0, None, 0,
                                     backward=False)
        blocks = info((2, 4, 8, 8), "int8", 4096) if blocks else None
        mods = _options.DeviceMods("struct UserMods;", (infos[0],), blocks)
        return _plan.forward(*infos, infos[0], made._replace(mods=mods), None, device(sm90a=True))

    assert all(isinstance(plan(d).steps[0].kernel, _plan.Kernel) for d in (64, 128, 256))
    with experiment.override(sm90_mods_tiles=MODS_TILES):
        for d, blocks, causal in ((64, False, False), (96, True, False), (128, True, True), (128, False, False)):
            p = plan(d, blocks, causal)
            kernel = p.steps[0].kernel
            assert isinstance(kernel, _plan.Sm90Forward) and p.struct is Sm90ModParams
            assert (kernel.consumers, kernel.block_n, kernel.extras) == (2, 64, True)
            assert kernel.instance.endswith(", true, cuflash::UserMods>") and kernel.mods == "struct UserMods;"
            params = Sm90ModParams.from_buffer_copy(p.params)
            assert params.tail_start == -(-1000 // 128) * 4 * 2 and params.tail_ctas == 0  # (whole tiles)
            assert bool(params.p.blocks.status) == blocks
            assert p.counters == (("tile_counter",) if blocks or causal else ())  # (uneven tiles: taken in turn)
        assert isinstance(plan(256).steps[0].kernel, _plan.Kernel)


def test_a_block_masked_mask_mod_alone_takes_the_plain_forward():
    """mask_mod alone with its block mask (no score_mod, softcap, ALiBi or dropout) takes the
    sm_90a forward's plain instance in 128-key tiles; with score_mod, softcap or no block
    mask, the extras' one where SM90_MODS_TILES names the head dim (by default none: the
    mma.sync forward) (test_sm90_backward: the backward alike)."""
    infos = [_arrays.inspect(np.zeros((2, 1000, 4, 128), np.float16), name) for name in ("q", "k", "v")]
    blocks = info((2, 4, 8, 8), "int8", 4096)
    mask_only = "struct UserMods { static constexpr bool kScore = false, kMask = true, kBlocks = true; };"
    scored = mask_only.replace("kScore = false", "kScore = true")

    def kernel(source, blocks, softcap=0.0, mods_tiles=None, varlen=None):
        made = _options.make_options(infos[0], infos[1], False, None, (-1, -1), softcap, None, 0.0, None, 0,
                                     backward=False)
        with experiment.override(sm90_mods_tiles=mods_tiles):
            return _plan.forward(*infos, infos[0], made._replace(mods=_options.DeviceMods(source, (), blocks)), varlen,
                                 device(sm90a=True)).steps[0].kernel

    plain = kernel(mask_only, blocks)  # (by default: SM90_MASK_TILES; below 2k rows the short causal tile)
    assert not plain.extras and (plain.block_n, plain.consumers, plain.blocks) == (128, 2, True)
    packed = _options.Varlen(info((3,), "int32"), info((3,), "int32"), 600, 600)
    assert kernel(mask_only, blocks, varlen=packed) == plain  # (packed sequences alike)
    for source, given, softcap in ((scored, blocks, 0.0), (mask_only, None, 0.0), (mask_only, blocks, 5.0)):
        assert isinstance(kernel(source, given, softcap), _plan.Kernel)  # (SM90_MODS_TILES empty: mma.sync)
        extras = kernel(source, given, softcap, MODS_TILES)
        assert extras.extras and (extras.block_n, extras.consumers) == (64, 2)


@pytest.mark.parametrize("seqlen,loads,consumers", [(2048, False, 3), (2047, False, 2), (4096, True, 2)])
def test_block_masked_d64_takes_the_causal_tiles(seqlen, loads, consumers):
    """At d 64 a block-masked mask_mod alone takes the built-in causal call's tiles: three
    consumers (192 rows over two rows of blocks) from SM90_SHORT_CAUSAL_ROWS query rows, two
    below; a mask that loads from its mod tensors keeps two (SM90_MASK_TENSOR_TILES)."""
    infos = [_arrays.inspect(np.zeros((1, seqlen, 4, 64), np.float16), name) for name in ("q", "k", "v")]
    blocks = info((1, 1, -(-seqlen // 128), -(-seqlen // 128)), "int8", 4096)
    body = "return t0[(long long)q_idx * t0_stride0] == 1;" if loads else "return kv_idx <= q_idx;"
    source = ("__device__ bool cuflash_mask_mod() { " + body + " }\n"
              "struct UserMods { static constexpr bool kScore = false, kMask = true, kBlocks = true; };")
    made = _options.make_options(infos[0], infos[1], False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    made = made._replace(mods=_options.DeviceMods(source, (), blocks))
    kernel = _plan.forward(*infos, infos[0], made, None, device(sm90a=True)).steps[0].kernel
    assert isinstance(kernel, _plan.Sm90Forward) and not kernel.extras and kernel.blocks
    assert (kernel.block_n, kernel.consumers, kernel.block_m) == (128, consumers, 64 * consumers)


def _t5_bias(s, b, h, q_idx, kv_idx, table, doc_q, doc_k):
    return s + table[h, mod.minimum(mod.maximum(q_idx - kv_idx, -16), 16) + 16]


def _same_document(b, h, q_idx, kv_idx, table, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim,dtype", [(64, "bfloat16"), (96, "float16"), (128, "bfloat16")])
@pytest.mark.parametrize("block_mask", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_mods_on_both_families(paths, head_dim, dtype, block_mask, causal):
    """A T5 bias and a document mask (rows whose document has no keys among them), with a
    block mask (its empty key tiles never loaded) or without, on each path against the oracle
    (the sm_90a one as experiment.override sends mods there)."""
    import cupy

    rng = np.random.default_rng(head_dim)
    host, (q, k, v) = _arrays_of(rng, dtype, (2, 300, 4, head_dim), (2, 517, 2, head_dim), (2, 517, 2, head_dim))
    tensors = (rng.standard_normal((4, 33)).astype(np.float32), np.sort(rng.integers(0, 6, (2, 300)), axis=1),
               np.sort(rng.integers(1, 7, (2, 517)), axis=1))
    device_tensors = tuple(cupy.asarray(t) for t in tensors)
    options = dict(causal=causal, score_mod=_t5_bias)
    if block_mask:
        options["block_mask"] = mod.create_block_mask(_same_document, 2, 4, 300, 517, mod_tensors=device_tensors,
                                                      like=q)
        statuses = cupy.asnumpy(options["block_mask"].statuses)
        assert (statuses == mod.EMPTY).any() and (statuses == mod.PARTIAL).any()
    else:
        options.update(mask_mod=_same_document, mod_tensors=device_tensors)
    ref, ref_lse = attention_reference(*host, causal=causal, score_mod=_t5_bias, mask_mod=_same_document,
                                       mod_tensors=tensors)
    error = lowp_error(attention_lowp(*host, causal=causal), attention_reference(*host, causal=causal)[0])
    with experiment.override(sm90_mods_tiles=MODS_TILES):
        for out, lse in _both_paths(paths, lambda: cuflash.attention(q, k, v, return_lse=True, **options)):
            check_output(out, ref, error, dtype)
            check_lse(lse, ref_lse)


def _block_kinds(b, h, q_idx, kv_idx, kinds):
    kind = kinds[q_idx // mod.BLOCK_SIZE, kv_idx // mod.BLOCK_SIZE]
    return (kind == 1) | ((kind == 2) & ((q_idx + kv_idx) % 5 != 0))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim,dtype", [(64, "float16"), (128, "bfloat16")])
@pytest.mark.parametrize("causal", [False, True])
def test_a_long_block_mask_row_on_both_families(paths, head_dim, dtype, causal):
    """Rows of 72 blocks (143 key tiles of 64: five words of the sm_90a forward's key-tile
    bits, two of its loads of four) whose blocks are drawn empty, full or partial, one query
    block with none shown (O = 0, LSE = +inf): each path against the oracle."""
    import cupy

    rng = np.random.default_rng(head_dim + causal)
    seqlen_q, seqlen_k = 3 * mod.BLOCK_SIZE - 40, 72 * mod.BLOCK_SIZE - 50
    host, (q, k, v) = _arrays_of(rng, dtype, (1, seqlen_q, 2, head_dim), (1, seqlen_k, 2, head_dim),
                                 (1, seqlen_k, 2, head_dim))
    kinds = rng.choice(3, (3, 72), p=(0.5, 0.25, 0.25)).astype(np.int32)
    kinds[1] = 0
    kinds[0, 40:70] = 0  # (a run of empty blocks across words)
    block_mask = mod.create_block_mask(_block_kinds, 1, 2, seqlen_q, seqlen_k, mod_tensors=(cupy.asarray(kinds),),
                                       like=q)
    statuses = cupy.asnumpy(block_mask.statuses)
    assert {mod.EMPTY, mod.PARTIAL, mod.FULL} <= set(np.unique(statuses))
    ref, ref_lse = attention_reference(*host, causal=causal, mask_mod=_block_kinds, mod_tensors=(kinds,))
    assert np.isinf(ref_lse[0, :, mod.BLOCK_SIZE:2 * mod.BLOCK_SIZE]).all()
    error = lowp_error(attention_lowp(*host, causal=causal), attention_reference(*host, causal=causal)[0])
    with experiment.override(sm90_mods_tiles=MODS_TILES):
        for out, lse in _both_paths(paths, lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True,
                                                                     block_mask=block_mask)):
            check_output(out, ref, error, dtype)
            check_lse(lse, ref_lse)
