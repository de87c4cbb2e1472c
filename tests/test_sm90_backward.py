"""The sm_90a backward (cuda/sm90/bwd.cu) and its wide kernel (cuda/sm90/bwd_wide.cu): the
planner sends them the calls they take and no other (no GPU needed); on a Hopper GPU their
gradients meet flash-attn's rule against the float64 oracle (test_gpu_backward.check_gradients)
in NaN-poisoned memory, on ragged lengths (1, a block + 1, primes), seqlen_q != seqlen_k, GQA
and MQA, causal masks and windows, head dims 64 to 128 and 161 to 256 (those between on the
copy engine's zero columns), packed sequences, the LSE's gradient; bwd.cu with softcap,
ALiBi, dropout, score_mod / mask_mod and block masks; with every launch planned on the
kernel the test names."""
import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _compile, _device, _options, _plan, experiment
from cuflash._params import Sm90BackwardModParams, Sm90BackwardParams

from .conftest import hopper
from .strategies import (Shape, VarlenShape, attention_shapes, random_dout, random_qkv, record_calls,
                         window_sizes)
from .test_device import gpus  # noqa: F401 (a fixture)
from .test_gpu_backward import check_gradients, packed_inputs
from .test_gpu_forward import cupy_dtype, poisoned_allocations
from .test_gpu_mods import _run as run_mods
from .test_gpu_mods import BLOCK_CASES
from .test_gpu_mods import _run_blocks as run_blocks
from .test_gpu_variants import FEATURES, api_options, run_dense, run_varlen
from .test_plan import dense, device, info, no_compiler  # noqa: F401 (a fixture)


def _backward_plan(head_dim=128, *, deterministic=False, softcap=0.0, dropout_p=0.0, alibi=False, mods=None,
                   causal=True, sm90a=True, ptr=1 << 20, dtype="bfloat16", facts=None, seqlen_q=300, seqlen_k=301,
                   window=(-1, -1)):
    """The backward's plan of a (2, ``seqlen_q``, ``seqlen_k``, 4 heads, 2 KV heads) call on a
    stand-in GPU (``facts``, a _device.Device; by default one with the sm_90a kernels where
    ``sm90a``)."""
    facts = device(sm90a=sm90a) if facts is None else facts
    q, k, v = dense(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
    q = info(q.shape, dtype, ptr)
    options = _options.make_options(q, k, causal, None, window, softcap, None, dropout_p, 1, 0, backward=True)
    options = options._replace(alibi=info((4,), "float32") if alibi else None, mods=mods)
    ordered = deterministic and _plan.backward_orders(head_dim, options.extras, mods is not None and
                                                      mods.blocks is not None, facts.sm90a)
    work = _plan.backward_workspace(q.shape, deterministic, options.extras, ordered)
    accum, semaphore = (info(work[name][0], work[name][1]) if name in work else None
                        for name in ("dq_accum", "dq_semaphore"))
    return _plan.backward(info(q.shape, dtype), q, k, v, info(q.shape, dtype), info(q.shape, dtype),
                          info(k.shape, dtype), info(v.shape, dtype), accum, options, None, facts, semaphore)


def test_a_launch_encodes_the_maps_only_when_a_mapped_array_moves(monkeypatch):
    """The backward's maps hold q's, k's, v's and dout's addresses: a launch whose other
    pointers (out, the gradients, the scratch: fresh each call) moved writes no map into its
    Params, one whose q moved writes all four again (the driver encoding q's alone: maps are
    kept by their arguments), on a stand-in driver."""
    from cuflash import _driver, _kernels, _tensormap
    encoded, made = [], []

    def fake_encode(result, dtype, rank, pointer, *rest):
        encoded.append(pointer.value)
        return 0

    def counted(pointer, *args):
        made.append(pointer)
        return kept(pointer, *args)

    kept = _tensormap.encode
    monkeypatch.setattr(_tensormap, "encode_function", lambda: fake_encode)
    monkeypatch.setattr(_tensormap, "encode", counted)
    monkeypatch.setattr(_compile, "load_kernel", lambda kernel, device: 1)
    monkeypatch.setattr(_driver, "primary_context", lambda device: 5)
    monkeypatch.setattr(_driver, "launcher", lambda: (lambda *args: None, lambda: 5))
    monkeypatch.setattr(_driver, "zero_words", lambda *args: None)
    monkeypatch.setattr(_driver, "in_context", lambda device: contextlib.nullcontext())
    kept.cache_clear()
    try:
        plan = _backward_plan(causal=False)
        launcher = _kernels.Launcher(plan, 0)
        mapped = {plan.pointers.index(f"p.{name}") for name in ("dout", "q", "k", "v")}

        def launch(moved=()):  # pointers 16 bytes apart; those in moved 4096 bytes further on
            launcher(7, *((1 << 20) + 16 * i + (4096 if i in moved else 0) for i in range(len(plan.pointers))))

        launch()
        assert len(made) == len(encoded) == len(plan.maps) == 4
        launch(moved=set(range(len(plan.pointers))) - mapped)
        assert len(made) == len(encoded) == 4
        q = plan.pointers.index("p.q")
        launch(moved={q})
        assert len(made) == 8 and encoded[4:] == [(1 << 20) + 16 * q + 4096]
    finally:
        kept.cache_clear()


@pytest.mark.parametrize("head_dim", [128, 256])
def test_under_a_mask_the_backward_starts_its_longest_key_blocks_first(no_compiler, head_dim):
    """Causal (and windowed) backwards run tile-major (GridTile: key block 0 of each pair of
    a group first) in groups of (KV head, sequence) pairs whose Q, dO and dQ's accumulator
    fit SM90_BACKWARD_SECTION_BYTES, of equal size; without a mask the grid's own order."""
    def group(**kwargs):
        plan = _backward_plan(head_dim, **kwargs)
        return plan.struct.from_buffer_copy(plan.params).p.tile_group

    pair_bytes = 300 * head_dim * 2 * 8  # (2 query heads a KV head)
    assert group(causal=True) == 4 and group(causal=False) == 0  # 2 sequences x 2 KV heads
    for pairs_fitting, expected in ((1, 1), (2, 2), (3, 2)):  # (3 of 4 pairs: two groups of 2)
        with experiment.override(sm90_backward_section_bytes=pairs_fitting * pair_bytes):
            assert group(causal=True) == expected
    if head_dim == 128:  # (deterministic calls of d 256 take the mma.sync passes)
        assert group(causal=True, deterministic=True) == 4  # (the kernel keeps its order then: bwd.cu)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_calls_convert_dq_beside_the_sm90_backward_where_the_device_launches_dependents(no_compiler, causal):
    """With programmatic dependent launches, a dense call's dQ conversion at the tile of 64
    query rows (d 65-128) is the backward's dependent, one grid column a (sequence, head),
    told the kernel's key blocks to wait for, and the kernel counts each CTA's end; without
    them, at d 64 (128 rows) and on the wide kernel, the conversion after the kernel and no
    count."""
    def last_step_and_count(head_dim, **flags):
        plan = _backward_plan(head_dim, causal=causal, facts=device(sm90a=True, **flags))
        return plan.steps[-1], plan.struct.from_buffer_copy(plan.params).count_done

    for head_dim, lanes in ((96, 16), (128, 16)):
        step, count = last_step_and_count(head_dim, dependent_launches=True)
        assert step.kernel.kind == "backward_convert_dq_by_head" and step.dependent and step.argument == "p"
        assert step.grid == (-(-300 * lanes // 256), 4, 2) and step.args[-1] == -(-301 // 128) and count == 1
    for head_dim, dependent in ((128, False), (64, True), (256, True)):
        step, count = last_step_and_count(head_dim, dependent_launches=dependent)
        assert step.kernel.kind == "backward_convert_dq" and not step.dependent and count == 0


@pytest.mark.parametrize("head_dim,kernel_head_dim", [(64, 64), (80, 128), (96, 128), (128, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_planner_sends_the_sm90_backward_what_it_takes(no_compiler, head_dim, kernel_head_dim, causal):
    plan = _backward_plan(head_dim, causal=causal)
    assert plan.struct is Sm90BackwardParams
    assert [s.kernel.kind for s in plan.steps] == ["backward_preprocess", "backward_sm90", "backward_convert_dq"]
    preprocess, kernel, convert = plan.steps
    assert preprocess.argument == convert.argument == "p" and kernel.argument == ""
    assert kernel.kernel == _plan.Sm90Backward.of("bfloat16", kernel_head_dim, causal)
    assert kernel.grid == (-(-301 // 128), 2, 2)
    assert plan.pointers == tuple(f"p.{n}" for n in _plan.BACKWARD_POINTERS)
    assert {(m.field, m.rows) for m in plan.maps} == {("q", kernel.kernel.block_m), ("dout", kernel.kernel.block_m),
                                                      ("k", 128), ("v", 128)}
    params = Sm90BackwardParams.from_buffer_copy(plan.params)
    assert params.batch == 2 and params.accum_cols == _plan.head_dim_bucket(head_dim)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_calls_take_the_sm90_backward_in_order(no_compiler, head_dim, causal):
    """dQ's additions take turns on semaphores laid out like D (zeroed by the preprocess)."""
    plan = _backward_plan(head_dim, deterministic=True, causal=causal)
    assert plan.struct is Sm90BackwardParams and "p.dq_semaphore" in plan.pointers
    assert [s.kernel.kind for s in plan.steps] == ["backward_preprocess", "backward_sm90", "backward_convert_dq"]
    work = _plan.backward_workspace((2, 300, 4, head_dim), True, False, ordered=True)
    assert work["dq_semaphore"] == (work["delta"][0], "int32") and "dq_accum" in work


MODS = _options.DeviceMods("struct UserMods;", (info((4, 9), "float32"),))  # (text the planner only passes on)
BLOCK_MASK = MODS._replace(blocks=info((1, 1, 3, 3), "int8"))
MASK_ONLY = BLOCK_MASK._replace(source="struct UserMods { static constexpr bool kScore = false, kMask = true; };")


@pytest.mark.parametrize("head_dim", [72, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_calls_take_80_query_rows_a_step_with_dq_transposed(no_compiler, head_dim, dtype, causal):
    """Without extras or the deterministic order, on dense rows that come in eights, d 65-128
    takes SM90_BACKWARD_DENSE_TILES (FlashAttention-3's 80 rows), causal or not: dQ^T in
    DqAccum's transposed order, rounded by 16 threads a block of 8 rows x 16 columns, beside the
    kernel's last CTAs where the device launches dependents; the compile sweep builds it and
    its shared memory fits."""
    columns = _plan.head_dim_bucket(head_dim)  # (the accumulator's)
    for dependent in (False, True):
        with experiment.override(sm90_backward_dense_band_rows=0):  # (under a mask: bands of any width)
            plan = _backward_plan(head_dim, causal=causal, seqlen_q=304, dtype=dtype,
                                  facts=device(sm90a=True, dependent_launches=dependent))
        kinds = ["backward_preprocess", "backward_sm90",
                 "backward_convert_dq_transposed_by_head" if dependent else "backward_convert_dq_transposed"]
        assert [s.kernel.kind for s in plan.steps] == kinds
        kernel, convert = plan.steps[1].kernel, plan.steps[2]
        assert kernel == _plan.Sm90Backward(dtype, 128, causal, False, 80, 2) and kernel.transposed_dq
        assert kernel.instance == (f"cuflash::attention_backward_sm90<{_plan.DTYPES[dtype]}, 128, 80, 2, "
                                   f"{str(causal).lower()}, false>")
        assert kernel in _plan.all_kernels("sm_90a") and kernel.shared_bytes <= _plan.shared_memory_limit("sm_90a")
        assert {(m.field, m.rows) for m in plan.maps} == {("q", 80), ("dout", 80), ("k", 128), ("v", 128)}
        assert convert.grid == ((-(-304 * columns // (8 * 256)), 4, 2) if dependent
                                else (-(-2 * 304 * 4 * columns // (8 * 256)), 1, 1))
        assert convert.dependent == dependent == plan.struct.from_buffer_copy(plan.params).count_done
        if dependent:
            assert convert.args[-1] == -(-301 // 128)  # (the kernel's key blocks: the count to wait for)
    with experiment.override(sm90_backward_dense_tiles={}, sm90_backward_dense_band_rows=0):
        assert _backward_plan(head_dim, causal=causal, seqlen_q=304).steps[1].kernel.block_m == 64


@pytest.mark.parametrize("seqlen_q,window,rows", [(304, (-1, -1), 80), (304, (-1, 0), 64), (4096, (-1, 0), 80),
                                                  (4088, (-1, 0), 64), (8192, (-1, 0), 80), (8192, (3000, 968), 80),
                                                  (8192, (3000, 967), 64), (8192, (100, -1), 80)])
def test_under_a_mask_the_80_row_tile_takes_bands_of_4096_rows_or_more(no_compiler, seqlen_q, window, rows):
    """Under a causal mask or a window, calls whose key blocks see SM90_BACKWARD_DENSE_BAND_ROWS
    query rows or more (the window's width and a block of 128 keys; a causal call or an
    unbounded side: all rows); shorter bands keep 64 rows a step."""
    causal = window == (-1, 0)
    call = dict(causal=causal, window=(-1, -1) if causal else window, seqlen_q=seqlen_q, seqlen_k=seqlen_q)
    assert _backward_plan(**call).steps[1].kernel.block_m == rows
    with experiment.override(sm90_backward_dense_band_rows=0):
        assert _backward_plan(**call).steps[1].kernel.block_m == 80


@pytest.mark.parametrize("case", [dict(seqlen_q=300), dict(deterministic=True), dict(causal=True, deterministic=True),
                                  dict(softcap=5.0), dict(dropout_p=0.1), dict(mods=MASK_ONLY), dict(head_dim=64)])
def test_the_rest_keeps_64_query_rows_a_step(no_compiler, case):
    """Rows that do not come in eights (a group of 8 rows of dQ's accumulator would hold two
    sequences' rows), the deterministic order, extras and mods; d 64 keeps its 128."""
    kernel = _backward_plan(**{"causal": False, "seqlen_q": 304, **case}).steps[1].kernel
    assert kernel.block_m == (128 if case.get("head_dim") == 64 else 64) and not kernel.transposed_dq


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_block_masked_mask_mod_alone_takes_the_plain_backward(no_compiler, head_dim):
    """mask_mod alone with its block mask rides on the plain instance (its hidden scores -inf
    before the exp); without the block mask, or with softcap, on the extras' one."""
    kernel = _backward_plan(head_dim, mods=MASK_ONLY).steps[1].kernel
    assert kernel == _plan.Sm90Backward.of("bfloat16", head_dim, True, False, MASK_ONLY.source)
    assert not kernel.extras and kernel.instance.endswith(", true, false, cuflash::UserMods>")
    for case in (dict(mods=MASK_ONLY._replace(blocks=None)), dict(mods=MASK_ONLY, softcap=5.0)):
        assert _backward_plan(head_dim, **case).steps[1].kernel.extras


@pytest.mark.parametrize("case", [dict(softcap=5.0), dict(alibi=True, causal=False), dict(dropout_p=0.1),
                                  dict(mods=MODS, head_dim=96), dict(mods=BLOCK_MASK), dict(softcap=5.0, head_dim=64),
                                  dict(mods=MODS, head_dim=64), dict(dropout_p=0.1, deterministic=True, head_dim=64),
                                  dict(softcap=5.0, deterministic=True), dict(mods=MODS, deterministic=True)])
def test_softcap_alibi_dropout_and_mods_take_the_sm90_backward_with_extras(no_compiler, case):
    """The extras' instance (P^T and dS^T made together), the mods' text compiled in front
    of it and their tensors after Params; deterministic too where no block mask leaves
    steps out."""
    plan = _backward_plan(**case)
    mods = case.get("mods")
    assert plan.struct is (Sm90BackwardParams if mods is None else Sm90BackwardModParams)
    assert [s.kernel.kind for s in plan.steps] == ["backward_preprocess", "backward_sm90", "backward_convert_dq"]
    kernel = plan.steps[1].kernel
    assert kernel == _plan.Sm90Backward.of("bfloat16", 64 if case.get("head_dim") == 64 else 128,
                                           case.get("causal", True), True,
                                           "" if mods is None else mods.source)
    assert kernel.extras and kernel.instance.endswith(", true, cuflash::UserMods>" if mods else ", true>")
    params = plan.struct.from_buffer_copy(plan.params)
    assert (params.p.softcap, params.batch) == (case.get("softcap", 0.0), 2)
    if mods is not None:
        assert params.p.tensors[0].ptr == mods.tensors[0].ptr and (mods.blocks is None) == (not params.p.blocks.status)
        assert _plan.pointer_offsets(plan.struct, plan.pointers) == \
            _plan.pointer_offsets(Sm90BackwardParams, plan.pointers)  # (the pointers are Params' either way)


@pytest.mark.parametrize("case", [dict(head_dim=160), dict(head_dim=224), dict(head_dim=32), dict(sm90a=False),
                                  dict(ptr=(1 << 20) + 8), dict(deterministic=True, head_dim=256),
                                  dict(deterministic=True, sm90a=False), dict(deterministic=True, ptr=(1 << 20) + 8),
                                  dict(deterministic=True, mods=BLOCK_MASK)])
def test_the_rest_keeps_the_mma_sync_backward(no_compiler, case):
    """Head dims outside 64-128 and the wide kernel's buckets, other GPUs and arrays the copy
    engine cannot read; deterministic ones there on the dQ pass (an ordered workspace the
    sm_90a kernel cannot take included), and deterministic calls with a block mask."""
    plan = _backward_plan(**case)
    assert plan.struct not in (Sm90BackwardParams, Sm90BackwardModParams)
    if case.get("deterministic"):
        assert [s.kernel.kind for s in plan.steps] == ["backward_preprocess", "backward_dq", "backward_dkdv"]


@pytest.mark.parametrize("head_dim", [176, 192, 240, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_planner_sends_the_wide_sm90_backward_head_dims_161_to_192_and_225_to_256(no_compiler, head_dim, causal,
                                                                                      dtype):
    """dK and dV of 64 keys by d 256 do not fit the registers: the wide kernel, one instance
    of head dim 256 (smaller ones on the copy engine's zero columns), a CTA a block of 80 keys,
    64 query rows a step; dQ's accumulator as wide as the head dim's bucket."""
    plan = _backward_plan(head_dim, causal=causal, dtype=dtype)
    assert plan.struct is Sm90BackwardParams
    assert [s.kernel.kind for s in plan.steps] == ["backward_preprocess", "backward_sm90_wide", "backward_convert_dq"]
    preprocess, kernel, convert = plan.steps
    assert preprocess.argument == convert.argument == "p" and kernel.argument == ""
    assert kernel.kernel == _plan.Sm90WideBackward(dtype, 256, causal)
    assert kernel.kernel in _plan.all_kernels("sm_90a")  # (the compile sweep builds it)
    assert kernel.kernel.instance == \
        f"cuflash::attention_backward_sm90_wide<{_plan.DTYPES[dtype]}, 256, {str(causal).lower()}>"
    assert kernel.grid == (-(-301 // 80), 2, 2)
    # K and V (80 x 256), two Q stages and dO (64 x 256), two P and two dS tiles (80 x 64),
    # two LSE rows and one D row, 7 barriers, the alignment's 1024
    assert (kernel.kernel.threads, kernel.kernel.shared_bytes) == (384, 223032)
    assert kernel.kernel.shared_bytes <= _plan.shared_memory_limit("sm_90a")
    assert plan.pointers == tuple(f"p.{n}" for n in _plan.BACKWARD_POINTERS)
    assert {(m.field, m.rows) for m in plan.maps} == {("q", 64), ("dout", 64), ("k", 80), ("v", 80)}
    params = Sm90BackwardParams.from_buffer_copy(plan.params)
    assert params.batch == 2 and params.accum_cols == _plan.head_dim_bucket(head_dim) == (192 if head_dim <= 192
                                                                                           else 256)


@pytest.mark.parametrize("case", [dict(softcap=5.0), dict(alibi=True, causal=False), dict(dropout_p=0.1),
                                  dict(mods=MODS), dict(mods=MASK_ONLY), dict(deterministic=True),
                                  dict(deterministic=True, causal=False), dict(sm90a=False), dict(ptr=(1 << 20) + 8)])
@pytest.mark.parametrize("head_dim", [192, 256])
def test_the_wide_head_dims_keep_the_mma_sync_backward_for_what_the_wide_kernel_leaves_out(no_compiler, case,
                                                                                          head_dim):
    """Softcap, ALiBi, dropout, mods and block masks, the deterministic order (the dK/dV and
    dQ passes: no dQ accumulator to add to in order), other GPUs, unaligned arrays."""
    plan = _backward_plan(head_dim, **case)
    assert plan.struct not in (Sm90BackwardParams, Sm90BackwardModParams)
    assert [s.kernel.kind for s in plan.steps] == (
        ["backward_preprocess", "backward_dq", "backward_dkdv"] if case.get("deterministic")
        else ["backward_preprocess", "backward", "backward_convert_dq"])


def test_portable_calls_keep_the_mma_sync_backward_at_the_wide_head_dims(no_compiler, gpus, monkeypatch):
    """CUFLASH_PORTABLE=1 (read at each call of the device's facts): no sm_90a kernel."""
    h100 = _device.facts(0)
    assert _backward_plan(256, facts=h100).steps[1].kernel.kind == "backward_sm90_wide"
    monkeypatch.setenv("CUFLASH_PORTABLE", "1")
    assert _backward_plan(256, facts=_device.facts(0)).steps[1].kernel.kind == "backward"


def test_the_override_of_the_wide_buckets_sends_their_calls_back(no_compiler):
    """experiment.override(sm90_wide_backward_buckets=()) runs them on the mma.sync backward
    (the comparison the wide kernel is timed against); the package's buckets come back after."""
    def kernel_kind(head_dim):
        return _backward_plan(head_dim).steps[1].kernel.kind

    with experiment.override(sm90_wide_backward_buckets=()):
        assert [kernel_kind(d) for d in (192, 256)] == ["backward", "backward"]
    with experiment.override(sm90_wide_backward_buckets=(256,)):
        assert [kernel_kind(d) for d in (192, 256)] == ["backward", "backward_sm90_wide"]
    assert [kernel_kind(d) for d in (128, 192, 256)] == ["backward_sm90", "backward_sm90_wide", "backward_sm90_wide"]


def test_the_sweep_holds_every_wide_instance():
    """``python -m cuflash compile --arch sm_90a`` builds what the planner may launch."""
    wide = [k for k in _plan.all_kernels("sm_90a") if isinstance(k, _plan.Sm90WideBackward)]
    assert sorted(wide) == sorted(_plan.Sm90WideBackward(dtype, 256, local) for dtype in _plan.DTYPES
                                  for local in (False, True))


# -- on a Hopper GPU -----------------------------------------------------------------------

def _plans_launching(monkeypatch, kernels: set[str]):
    """Every backward planned inside launches ``kernels`` between the elementwise steps (plans
    made afresh, for the device's own kernels)."""
    planned = record_calls(monkeypatch, _plan, "backward")
    monkeypatch.setenv("CUFLASH_PORTABLE", "0")
    with experiment.override():  # (no plan made before, nor kept after)
        yield planned
    elementwise = {"backward_preprocess", "backward_convert_dq", "backward_convert_dq_by_head",
                   "backward_convert_dq_transposed", "backward_convert_dq_transposed_by_head"}
    assert planned and all({s.kernel.kind for s in p.steps} - elementwise == kernels for p in planned if p.steps)


@pytest.fixture
def sm90_plans(monkeypatch):
    """Every backward planned inside is checked to take the sm_90a kernel."""
    yield from _plans_launching(monkeypatch, {"backward_sm90"})


@pytest.fixture
def wide_plans(monkeypatch):
    """Every backward planned inside is checked to take the wide sm_90a kernel."""
    yield from _plans_launching(monkeypatch, {"backward_sm90_wide"})


@pytest.fixture
def plans_of(request, monkeypatch):
    """Every backward planned inside is checked to take the kernel the test names (indirect)."""
    yield from _plans_launching(monkeypatch, {request.param})


@pytest.fixture
def two_pass_plans(monkeypatch):
    """Every backward planned inside is checked to take the mma.sync dQ and dK/dV passes."""
    yield from _plans_launching(monkeypatch, {"backward_dq", "backward_dkdv"})


def _gradients(shape, dtype: str, seed: int, window_size=(-1, -1), dlse: bool = False, repeats: int = 1,
               deterministic: bool = False):
    """(dout, q, k, v), the gradients of a fresh forward's out (and lse) ``repeats`` times
    (one list of three each), dlse."""
    import cupy
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(shape, cupy_dtype(dtype), rng, xp=cupy)
    dout = random_dout(shape, cupy_dtype(dtype), rng, xp=cupy)
    out, lse = cuflash.attention(q, k, v, causal=shape.causal, window_size=window_size, return_lse=True)
    gradient_of_lse = cupy.asarray(rng.standard_normal(lse.shape), dtype=cupy.float32) if dlse else None
    with poisoned_allocations():
        runs = [cuflash.attention_backward(dout, q, k, v, out, lse, causal=shape.causal, window_size=window_size,
                                           dlse=gradient_of_lse, deterministic=deterministic)
                for _ in range(repeats)]
    return (dout, q, k, v), runs[0] if repeats == 1 else runs, gradient_of_lse


def _check(shape, dtype, seed, window_size=(-1, -1), dlse=False):
    (dout, q, k, v), grads, gradient_of_lse = _gradients(shape, dtype, seed, window_size, dlse)
    check_gradients(dout, q, k, v, grads, shape.causal, dlse=gradient_of_lse, window_size=window_size)


def _bitwise_equal(first, second) -> bool:
    import cupy
    return all(bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()) for a, b in zip(first, second))


# Deterministic: d 128 (dQ by the copy engine) and d 64 (by red.v4), in order and, under a
# causal mask or window, backwards; GQA; many key blocks taking turns on a query block.
DETERMINISTIC = [(Shape(2, 777, 1029, 8, 2, 128, False), (-1, -1)), (Shape(1, 1500, 1300, 4, 1, 128, True), (-1, -1)),
                 (Shape(2, 700, 900, 6, 2, 96, False), (100, 30)), (Shape(1, 1025, 2049, 4, 4, 64, False), (-1, -1)),
                 (Shape(2, 333, 1100, 4, 2, 64, True), (-1, -1))]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape,window_size", DETERMINISTIC, ids=str)
def test_deterministic_calls_match_the_oracle_bit_for_bit_each_time(sm90_plans, shape, window_size):
    (dout, q, k, v), runs, _ = _gradients(shape, "bfloat16", 11, window_size, repeats=3, deterministic=True)
    assert all(_bitwise_equal(runs[0], again) for again in runs[1:])
    check_gradients(dout, q, k, v, runs[0], shape.causal, window_size=window_size)


def drawn_calls(head_dims: list[int]) -> dict:
    """hypothesis' draws of a backward call (shape, dtype, window, dlse, seed) at these head dims."""
    return dict(shape=attention_shapes(max_batch=2, max_seqlen=700, max_nheads_kv=2, max_group=3,
                                       headdim=st.sampled_from(head_dims)),
                dtype=st.sampled_from(["float16", "bfloat16"]), window=st.one_of(st.none(), window_sizes(700)),
                dlse=st.booleans(), seed=st.integers(0, 2**32 - 1))


drawn_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("plans_of,head_dims", [("backward_sm90", [64, 72, 96, 128]),
                                                ("backward_sm90_wide", [176, 192, 232, 256])], indirect=["plans_of"])
@settings(drawn_settings, max_examples=50)
@given(data=st.data())
def test_drawn_calls_match_the_oracle(plans_of, head_dims, data):
    call = data.draw(st.fixed_dictionaries(drawn_calls(head_dims)))
    window = call["window"]
    window_size = (-1, -1) if window is None or call["shape"].causal else window
    _check(call["shape"], call["dtype"], call["seed"], window_size, call["dlse"])


# Dense calls whose dQ is converted beside the backward's last CTAs, each head once its KV
# head's key blocks have counted their ends, at 64 rows a step (the 80-row tile left out):
# GQA 4 (four heads wait on one count), one key, a block and 8 rows, many key blocks, rows in
# sixteens and not.
BESIDE = [Shape(2, 8, 129, 8, 2, 128, False), Shape(1, 72, 1, 4, 1, 96, False), Shape(3, 521, 77, 8, 2, 128, True),
          Shape(1, 2056, 1500, 4, 1, 80, False)]
# Dense calls whose rows come in eights: 80 query rows a step, dQ^T staged in its fragments'
# order (SM90_BACKWARD_DENSE_TILES). 8 rows (one group: the rest of the step past the end), a
# step, a step and a group; GQA 4, MHA and MQA; keys 1, a block + 1, primes, fewer and more
# than the rows under a causal mask (bottom-right: the first rows see no key); d 72 and 96 on
# zero columns (a consumer's half of dQ partly past the accumulator's row); many steps and key
# blocks.
EIGHTIES = [Shape(2, 8, 129, 8, 2, 128, False), Shape(1, 80, 1, 4, 1, 96, False), Shape(3, 88, 77, 4, 4, 128, False),
            Shape(1, 168, 1031, 6, 1, 72, False), Shape(2, 2000, 1999, 4, 2, 128, False),
            Shape(1, 4096, 4096, 2, 2, 128, False), Shape(2, 88, 77, 4, 2, 128, True),
            Shape(1, 168, 1031, 6, 1, 96, True), Shape(1, 2000, 2000, 4, 4, 128, True)]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape,rows", [*((s, 64) for s in BESIDE), *((s, 80) for s in EIGHTIES)], ids=str)
@pytest.mark.parametrize("dtype,dlse", [("bfloat16", False), ("float16", True)])
def test_dense_calls_at_64_and_80_rows_a_step_converting_dq_beside_match_the_oracle(sm90_plans, shape, rows, dtype,
                                                                                     dlse):
    with experiment.override(sm90_backward_dense_tiles=None if rows == 80 else {},
                             sm90_backward_dense_band_rows=0):  # (short causal calls on 80 rows too)
        _check(shape, dtype, 5 if rows == 64 else 7, dlse=dlse)
    plans = [p for p in sm90_plans if p.steps]
    assert plans and all(p.steps[1].kernel.block_m == rows and p.steps[-1].dependent for p in plans)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("window_size", [(100, 30), (0, 0), (-1, 50), (200, -1)])
def test_windows_on_80_query_rows_a_step_match_the_oracle(sm90_plans, window_size):
    """Sliding windows on the 80-row tile: each step's band cut across its 80 rows."""
    with experiment.override(sm90_backward_dense_band_rows=0):
        _check(Shape(2, 304, 517, 4, 2, 128, False), "bfloat16", 3, window_size)
    assert all(p.steps[1].kernel.block_m == 80 for p in sm90_plans if p.steps)


# Ragged lengths around the 128-key block and the 64- and 128-row query blocks: 1, a block
# + 1, primes; seqlen_q above and below seqlen_k; MQA; a long causal call.
LONG = [Shape(1, 1, 1, 1, 1, 128, False), Shape(2, 129, 129, 4, 2, 128, True), Shape(1, 257, 127, 6, 1, 64, True),
        Shape(1, 127, 1031, 4, 4, 96, False), Shape(2, 1999, 2047, 4, 2, 64, True),
        Shape(1, 81, 81, 2, 1, 128, False), Shape(2, 401, 160, 4, 2, 96, False), Shape(1, 79, 1000, 3, 1, 80, False),
        Shape(1, 2048, 2048, 8, 1, 128, True), Shape(1, 1025, 700, 2, 2, 128, False),
        Shape(1, 4096, 4096, 2, 2, 128, False)]




@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_match_the_oracle(sm90_plans, head_dim, causal):
    """Sequences shorter and longer than a block, one with no rows and one with no keys:
    a block's boxes reach into the next sequence's rows, which must count for nothing;
    sequences from row 100 on start inside a group of 8 rows (dQ by red.v4)."""
    _check_packed(VarlenShape((100, 0, 257, 64, 1), (130, 40, 0, 300, 129), 4, 2, head_dim, causal), ordered=2)


def _check_packed(shape: VarlenShape, ordered: int = 0):
    """The packed call's gradients against the oracle, and ``ordered`` deterministic calls'
    too, bit for bit alike."""
    (dout, q, k, v), packing = packed_inputs(shape, shape.headdim)
    cu_q, cu_k = packing[:2]
    out, lse = cuflash.attention_varlen(q, k, v, *packing, causal=shape.causal, return_lse=True)
    with poisoned_allocations():
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, causal=shape.causal)
        runs = [cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, causal=shape.causal,
                                                  deterministic=True) for _ in range(ordered)]
    for gradients in [grads] + runs[:1]:
        check_gradients(dout, q, k, v, gradients, shape.causal, varlen=(cu_q, cu_k))
    assert all(_bitwise_equal(runs[0], again) for again in runs[1:])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("feature", ["softcap", "alibi_heads", "alibi_batch_heads", "dropout", "everything"])
@pytest.mark.parametrize("head_dim,deterministic", [(64, False), (128, False), (96, True), (64, True)])
def test_softcap_alibi_and_dropout_match_the_oracle(sm90_plans, feature, head_dim, deterministic):
    """The extras' instance: P^T and dS^T made together, dropout's keep mask drawn by query
    and key as the forward's (GQA, lopsided, ragged; deterministic: in order)."""
    causal, variant = FEATURES[feature]
    run_dense(Shape(2, 333, 517, 4, 2, head_dim, causal), "bfloat16", 5, api_options(variant, causal),
              deterministic)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("feature", ["softcap", "dropout", "everything"])
def test_packed_sequences_with_extras_match_the_oracle(sm90_plans, feature):
    causal, variant = FEATURES[feature]
    shape = VarlenShape((300, 0, 129, 65), (517, 7, 0, 200), 4, 2, 96, causal)
    run_varlen(shape, "float16", 12, api_options(variant, causal))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", ["t5", "alibi", "softcap", "document", "document_varlen", "prefix", "bias"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_mods_match_the_oracle(sm90_plans, case, deterministic):
    """score_mod / mask_mod compiled into the sm_90a backward (the forward stays on the
    mma.sync kernels), dense and packed, GQA, ragged."""
    run_mods(case, (2, 257, 131, 2, 2), 7, deterministic)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", ["causal", "document", "t5_document", "sinks", "hidden"])
@pytest.mark.parametrize("shape", [(1, 383, 512, 2, 2), (2, 129, 300, 1, 2)], ids=str)
def test_block_masks_match_the_oracle(sm90_plans, case, shape):
    """The steps leave out the block mask's empty (query head, query block) pairs and skip
    mask_mod in its full ones."""
    run_blocks(BLOCK_CASES[case], shape, 8, False)


# -- the wide kernel (sm90/bwd_wide.cu) on a Hopper GPU ---------------------------------------
# Head dims 161-192 and 225-256 (d 256's instance, the rest on zero columns); ragged lengths
# around the 80-key block and the 64-row query block: 1, 80, a block + 1, primes; seqlen_q
# above and below seqlen_k (rows that see no key); MQA and GQA; a long causal call.
WIDE_LONG = [Shape(1, 1, 1, 1, 1, 256, False), Shape(2, 80, 80, 4, 2, 256, True), Shape(1, 81, 81, 2, 1, 192, False),
             Shape(2, 161, 81, 4, 2, 256, True), Shape(1, 127, 1031, 4, 4, 232, False),
             Shape(1, 257, 131, 6, 1, 176, True), Shape(2, 401, 160, 4, 2, 256, False),
             Shape(1, 79, 1000, 3, 1, 192, False), Shape(1, 2048, 2048, 4, 1, 256, True),
             Shape(1, 1025, 700, 2, 2, 256, False)]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("plans_of,shape", [("backward_sm90", s) for s in LONG] +
                         [("backward_sm90_wide", s) for s in WIDE_LONG], indirect=["plans_of"], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_and_ragged_calls_match_the_oracle(plans_of, shape, dtype):
    _check(shape, dtype, shape.seqlen_q + shape.seqlen_k)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("window_size", [(100, 0), (37, 250), (0, 0), (-1, 64)])
@pytest.mark.parametrize("plans_of,head_dim", [("backward_sm90", 128), ("backward_sm90_wide", 192),
                                               ("backward_sm90_wide", 256)], indirect=["plans_of"])
def test_windows_match_the_oracle(plans_of, window_size, head_dim):
    _check(Shape(2, 700, 900, 4, 2, head_dim, False), "bfloat16", 3, window_size)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_wide_sequences_match_the_oracle(wide_plans, head_dim, causal):
    """Sequences shorter and longer than a block, one with no rows and one with no keys:
    a block's boxes reach into the next sequence's rows, which must count for nothing; dQ's
    red.v4 and dK/dV's row stores from any first row."""
    _check_packed(VarlenShape((100, 0, 257, 80, 1, 33), (130, 40, 0, 300, 81, 161), 4, 2, head_dim, causal))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape", [Shape(2, 333, 517, 4, 2, 256, True), Shape(1, 700, 300, 4, 1, 192, False)],
                         ids=str)
def test_deterministic_wide_head_dims_take_the_mma_sync_passes_bit_for_bit(two_pass_plans, shape):
    """The wide kernel adds dQ by atomics, in no fixed order: deterministic calls keep the
    dQ and dK/dV passes, the same bits each time."""
    (dout, q, k, v), runs, _ = _gradients(shape, "bfloat16", 17, repeats=3, deterministic=True)
    assert all(_bitwise_equal(runs[0], again) for again in runs[1:])
    check_gradients(dout, q, k, v, runs[0], shape.causal)
