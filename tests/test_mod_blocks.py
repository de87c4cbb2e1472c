"""Block masks (cuflash.mod.create_block_mask, BlockMask) without a GPU: the statuses are exact
(against a block-by-block count over the whole mask), a call with a block mask equals the call
with its mask_mod alone on the NumPy path (and the float64 oracle), the NumPy path applies the
kernels' rule to any statuses, every misuse raises before anything runs, the planner hands the
statuses to the kernels, and the block-sparse kernel variants compile without spills."""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _compile, _params, _plan, mod
from cuflash.mod import BLOCK_SIZE, EMPTY, FULL, PARTIAL, BlockMask, create_block_mask, kernel_source, trace
from cuflash.reference import attention_reference, attention_reference_backward

from .strategies import NO_INVALID_ARITHMETIC, seeds
from .test_mod_kernels import KINDS, QKV, SPECS, _on_the_gpu, documents, pretend_gpu, relative_bias
from .test_plan import device

pytestmark = NO_INVALID_ARITHMETIC

LENGTHS = (1, 2, 7, 127, 128, 129, 131, 257, 300)


def causal(b, h, q_idx, kv_idx, diagonal):
    return kv_idx <= q_idx + diagonal[()]


def same_document(b, h, q_idx, kv_idx, diagonal, doc_q, doc_k, is_prefix):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx, diagonal, doc_q, doc_k, is_prefix):
    return (kv_idx <= q_idx + diagonal[()]) | is_prefix[b, kv_idx]


def window_with_sinks(b, h, q_idx, kv_idx, diagonal):
    distance = q_idx + diagonal[()] - kv_idx
    return ((distance >= 0) & (distance <= 100)) | (kv_idx < 4)


def rows_hidden(b, h, q_idx, kv_idx, diagonal):  # query rows 128 .. 255 see nothing; head 1 sees less
    return ((q_idx < 128) | (q_idx >= 256)) & ((h != 1) | (kv_idx % 3 == 0))


MASKS = {"causal": causal, "document": same_document, "prefix": prefix_lm, "sinks": window_with_sinks,
         "rows_hidden": rows_hidden}


def _tensors(name, rng, batch, seqlen_q, seqlen_k):
    diagonal = np.array(seqlen_k - seqlen_q, np.int32)
    if name in ("document", "prefix"):
        docs = max(1, seqlen_k // 90)
        return (diagonal, np.sort(rng.integers(0, docs, (batch, seqlen_q)), axis=1).astype(np.int32),
                np.sort(rng.integers(0, docs, (batch, seqlen_k)), axis=1).astype(np.int64),
                np.arange(seqlen_k)[None, :] < rng.integers(0, seqlen_k + 1, (batch, 1)))
    return (diagonal,)


def _brute_statuses(mask_mod, tensors, batch, heads, seqlen_q, seqlen_k):
    """Each block's status, counted block by block over the whole mask."""
    shown = np.broadcast_to(mod.to_numpy(trace(mask_mod, "mask", tensors))(
        np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None],
        np.arange(seqlen_q)[None, None, :, None], np.arange(seqlen_k)[None, None, None, :], *tensors),
        (batch, heads, seqlen_q, seqlen_k))
    out = np.empty((batch, heads, -(-seqlen_q // 128), -(-seqlen_k // 128)), np.int8)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            block = shown[:, :, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            out[:, :, i, j] = np.where(block.all(axis=(2, 3)), FULL, np.where(block.any(axis=(2, 3)), PARTIAL, EMPTY))
    return out


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(list(MASKS)), batch=st.integers(1, 2), heads=st.integers(1, 3),
       seqlen_q=st.sampled_from(LENGTHS), seqlen_k=st.sampled_from(LENGTHS), seed=seeds)
def test_statuses_are_exact(name, batch, heads, seqlen_q, seqlen_k, seed):
    tensors = _tensors(name, np.random.default_rng(seed), batch, seqlen_q, seqlen_k)
    bm = create_block_mask(MASKS[name], batch, heads, seqlen_q, seqlen_k, mod_tensors=tensors)
    expected = _brute_statuses(MASKS[name], tensors, batch, heads, seqlen_q, seqlen_k)
    reads = {v: mod._uses(bm.tree, v) for v in "bh"}
    assert bm.shape == (batch if reads["b"] else 1, heads if reads["h"] else 1, *expected.shape[2:])
    assert bm.statuses.dtype == np.int8
    np.testing.assert_array_equal(np.broadcast_to(bm.statuses, expected.shape), expected)
    with pytest.MonkeyPatch.context() as patch:  # chunks of one block row, heads one by one: the same
        patch.setattr(mod, "EVALUATED_POSITIONS", 1 << 13)
        again = create_block_mask(MASKS[name], batch, heads, seqlen_q, seqlen_k, mod_tensors=tensors)
    np.testing.assert_array_equal(again.statuses, bm.statuses)


def test_a_mask_without_b_or_h_may_leave_them_open():
    bm = create_block_mask(lambda b, h, i, j: j <= i, None, None, 300, 129)
    assert (bm.batch, bm.heads, bm.shape) == (None, None, (1, 1, 3, 2))
    np.testing.assert_array_equal(bm.statuses[0, 0], [[PARTIAL, EMPTY], [FULL, FULL], [FULL, FULL]])
    assert create_block_mask(lambda b, h, i, j: j <= i, None, None, 0, 5).shape == (1, 1, 0, 1)
    with pytest.raises(ValueError, match="reads b: give create_block_mask its batch"):
        create_block_mask(lambda b, h, i, j: b == 0, None, 2, 10, 10)
    with pytest.raises(ValueError, match="reads h: give create_block_mask its heads"):
        create_block_mask(lambda b, h, i, j: h == 0, 2, None, 10, 10)
    with pytest.raises(AttributeError, match="immutable"):
        bm.statuses = None


def _inputs(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=np.float64):
    q = rng.standard_normal((batch, seqlen_q, nheads, 32)).astype(dtype)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_kv, 32)).astype(dtype) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


@settings(deadline=None, max_examples=25)
@given(name=st.sampled_from(list(MASKS)), batch=st.integers(1, 2), seqlen_q=st.sampled_from(LENGTHS),
       seqlen_k=st.sampled_from(LENGTHS), group=st.integers(1, 2), seed=seeds, with_score=st.booleans(),
       causal_too=st.booleans())
def test_a_block_mask_gives_what_its_mask_mod_gives(name, batch, seqlen_q, seqlen_k, group, seed, with_score,
                                                    causal_too):
    """On the NumPy path: the call with the block mask equals the call with its mask_mod alone
    (bitwise: the same scores are masked) and the float64 oracle, forward and backward."""
    rng = np.random.default_rng(seed)
    nheads = 2 * group
    tensors = _tensors(name, rng, batch, seqlen_q, seqlen_k)
    q, k, v, dout = _inputs(rng, batch, seqlen_q, seqlen_k, nheads, 2)
    bm = create_block_mask(MASKS[name], batch, nheads, seqlen_q, seqlen_k, mod_tensors=tensors)
    score_mod = (lambda s, b, h, i, j, *t: s - 0.1 * abs(i - j)) if with_score else None
    options = dict(causal=causal_too, score_mod=score_mod)
    out, lse = cuflash.attention(q, k, v, block_mask=bm, return_lse=True, **options)
    plain, plain_lse = cuflash.attention(q, k, v, mask_mod=MASKS[name], mod_tensors=tensors, return_lse=True,
                                         **options)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    ref, ref_lse = attention_reference(q, k, v, mask_mod=MASKS[name], mod_tensors=tensors, **options)
    np.testing.assert_allclose(out, ref, atol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)  # (lse is float32)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, block_mask=bm, mask_mod=MASKS[name],
                                       mod_tensors=bm.mod_tensors, **options)
    plain_grads = cuflash.attention_backward(dout, q, k, v, plain, plain_lse, mask_mod=MASKS[name],
                                             mod_tensors=tensors, **options)
    refs = attention_reference_backward(dout, q, k, v, mask_mod=MASKS[name], mod_tensors=tensors, **options)
    for grad, plain_grad, reference in zip(grads, plain_grads, refs):
        np.testing.assert_array_equal(grad, plain_grad)
        # (through the float32 lse: relative to the gradient's size, which reaches tens)
        np.testing.assert_allclose(grad, reference, atol=1e-5 * (1 + np.abs(reference).max(initial=0.0)))


@settings(deadline=None, max_examples=15)
@given(lengths=st.lists(st.tuples(st.sampled_from((0,) + LENGTHS), st.sampled_from(LENGTHS)), min_size=1,
                        max_size=3), seed=seeds, causal_too=st.booleans())
def test_a_packed_call_takes_a_block_mask_over_its_sequences(lengths, seed, causal_too):
    """A packed (varlen) call's block mask is made over (sequences, heads, max_seqlen_q,
    max_seqlen_k), positions within each sequence: on the NumPy path the call equals the one
    with its mask_mod alone (bitwise), forward and backward, and the oracle sequence by
    sequence; a shorter sequence reads its row of the statuses over its own positions."""
    rng = np.random.default_rng(seed)
    lengths_q, lengths_k = zip(*lengths)
    batch, max_q, max_k = len(lengths), max(max(lengths_q), 1), max(lengths_k)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    doc_q, doc_k = (np.sort(rng.integers(0, 4, (batch, n)), axis=1).astype(np.int32) for n in (max_q, max_k))
    tensors = (np.array(max_k - max_q, np.int32), doc_q, doc_k, rng.random((batch, max_k)) < 0.2)
    q = rng.standard_normal((int(cu_q[-1]), 4, 32))
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, 32)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    bm = create_block_mask(same_document, batch, 4, max_q, max_k, mod_tensors=tensors)
    packing = (cu_q, cu_k, max_q, max_k)
    out, lse = cuflash.attention_varlen(q, k, v, *packing, block_mask=bm, causal=causal_too, return_lse=True)
    plain, plain_lse = cuflash.attention_varlen(q, k, v, *packing, mask_mod=same_document, mod_tensors=tensors,
                                                causal=causal_too, return_lse=True)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, block_mask=bm, causal=causal_too)
    plain_grads = cuflash.attention_varlen_backward(dout, q, k, v, plain, plain_lse, *packing, causal=causal_too,
                                                    mask_mod=same_document, mod_tensors=tensors)
    for grad, plain_grad in zip(grads, plain_grads):
        np.testing.assert_array_equal(grad, plain_grad)
    for b in range(batch):  # (the oracle: sequence b alone, the mask reading its row of the tensors)
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = (tensors[0], doc_q[b:b + 1], doc_k[b:b + 1], tensors[3][b:b + 1])
        ref, _ = attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal_too,
                                     mask_mod=same_document, mod_tensors=one)
        np.testing.assert_allclose(out[rows_q], ref[0], atol=1e-10)


def test_a_packed_call_checks_its_block_mask_against_its_sequences():
    q = np.zeros((10, 2, 32))
    cu = np.array([0, 4, 10], np.int32)
    tensors = (np.array(0, np.int32), np.zeros((2, 6), np.int32), np.zeros((2, 6), np.int32), np.zeros((2, 6), bool))
    made_for_3 = create_block_mask(same_document, 3, 2, 6, 6, mod_tensors=(tensors[0],) + tuple(
        np.zeros((3, 6), t.dtype) for t in tensors[1:]))
    with pytest.raises(ValueError, match="block_mask was made for batch 3, this call has 2"):
        cuflash.attention_varlen(q, q, q, cu, cu, 6, 6, block_mask=made_for_3)
    made_for_longer = create_block_mask(same_document, 2, 2, 300, 6, mod_tensors=(tensors[0],) + tuple(
        np.zeros((2, 300), t.dtype) for t in tensors[1:]))
    with pytest.raises(ValueError, match="block_mask was made for seqlen_q 300, this call has 6"):
        cuflash.attention_varlen(q, q, q, cu, cu, 6, 6, block_mask=made_for_longer)


def test_a_fully_masked_block_row_gives_zero_and_infinite_lse():
    rng = np.random.default_rng(1)
    tensors = (np.array(0, np.int32),)
    q, k, v, dout = _inputs(rng, 1, 300, 300, 2, 2)
    bm = create_block_mask(rows_hidden, 1, 2, 300, 300, mod_tensors=tensors)
    assert (bm.statuses[0, :, 1] == EMPTY).all()
    out, lse = cuflash.attention(q, k, v, block_mask=bm, return_lse=True)
    assert (out[0, 128:256] == 0).all() and np.isinf(lse[0, :, 128:256]).all() and np.isfinite(out).all()
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, block_mask=bm)
    assert (dq[0, 128:256] == 0).all() and all(np.isfinite(g).all() for g in (dq, dk, dv))


def test_the_numpy_path_applies_the_kernels_rule_to_any_statuses():
    """Empty blocks hidden, full ones shown without mask_mod, partial ones masked by it, even
    where the statuses disagree with the mask (a block mask made by hand)."""
    rng = np.random.default_rng(2)
    q, k, v, _ = _inputs(rng, 1, 200, 200, 1, 1)
    mask = lambda b, h, i, j: j <= i  # noqa: E731
    statuses = np.array([[[[FULL, EMPTY], [PARTIAL, FULL]]]], np.int8)
    bm = BlockMask(mask, (), trace(mask, "mask"), statuses, 1, 1, 200, 200)
    shown = np.tril(np.ones((200, 200), bool))
    shown[:128, :128] = True  # full: every key of the block
    shown[:128, 128:] = False  # empty
    shown[128:, 128:] = True
    out = cuflash.attention(q, k, v, block_mask=bm)
    ref, _ = attention_reference(q, k, v, mask_mod=lambda b, h, i, j, t: t[i, j], mod_tensors=(shown,))
    np.testing.assert_allclose(out, ref, atol=1e-10)


def test_block_mask_misuse_raises_naming_it():
    q, k, v = (np.zeros((2, 130, 4, 16)) for _ in range(3))
    doc = np.zeros((2, 130), np.int32)

    def docs(b, h, i, j, d):
        return d[b, i] == d[b, j]

    bm = create_block_mask(docs, 2, 4, 130, 130, mod_tensors=(doc,))
    cases = [
        (dict(block_mask="no"), TypeError, "block_mask must be a cuflash.mod.BlockMask"),
        (dict(block_mask=bm, mask_mod=lambda b, h, i, j, d: i >= j), ValueError, "mask_mod must be block_mask's own"),
        (dict(block_mask=bm, mod_tensors=(doc.copy(),)), ValueError, "mod_tensors must be block_mask's own 1"),
        (dict(block_mask=create_block_mask(docs, 2, 4, 129, 130, mod_tensors=(doc,))), ValueError,
         "block_mask was made for seqlen_q 129, this call has 130"),
        (dict(block_mask=create_block_mask(lambda b, h, i, j: i >= j, None, None, 130, 131)), ValueError,
         "block_mask was made for seqlen_k 131"),
        (dict(block_mask=create_block_mask(docs, 2, 2, 130, 130, mod_tensors=(doc,))), ValueError,
         "block_mask was made for heads 2, this call has 4"),
        (dict(block_mask=create_block_mask(lambda b, h, i, j: i >= j, 3, None, 130, 130)), ValueError,
         "block_mask was made for batch 3, this call has 2"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            cuflash.attention(q, k, v, **kwargs)
        with pytest.raises(error, match=message):
            cuflash.attention_backward(q, q, k, v, q, np.zeros((2, 4, 130), np.float32), **kwargs)
    cuflash.attention(q, k, v, block_mask=bm, mask_mod=docs, mod_tensors=(doc,))  # (the same: accepted)
    with pytest.raises(ValueError, match="block_mask was made for batch 2, this call has 1"):  # (one sequence)
        cuflash.attention_varlen(q[0], k[0], v[0], np.array([0, 130], np.int32), np.array([0, 130], np.int32), 130,
                                 130, block_mask=bm)
    for args, kwargs, error, message in [
        ((docs, 2, 4, 130, 130), dict(mod_tensors=(doc,), like=[1]), TypeError, "like must be None, a NumPy array"),
        ((docs, 2, 4, 130, 130), dict(mod_tensors=[[1]]), TypeError, r"mod_tensors\[0\] must be a numpy array"),
        ((docs, 0, 4, 130, 130), dict(mod_tensors=(doc,)), ValueError, "batch must be a positive integer or None"),
        ((docs, 2, 4, -1, 130), dict(mod_tensors=(doc,)), ValueError, "seqlen_q must be an integer"),
        ((docs, 2, 4, 130, 1.5), dict(mod_tensors=(doc,)), TypeError, "seqlen_k must be an integer"),
        (("docs", 2, 4, 130, 130), {}, TypeError, "mask_mod must be a function"),
        ((docs, 2, 4, 130, 131), dict(mod_tensors=(doc,)), IndexError, "index 1 of mod tensor"),
    ]:
        with pytest.raises(error, match=message):
            create_block_mask(*args, **kwargs)


@pytest.fixture
def fake_gpu(monkeypatch):
    """test_mod_kernels' fake_gpu: calls see CuPy arrays, launching raises."""
    return pretend_gpu(monkeypatch)


def test_block_mask_calls_plan_the_statuses_into_the_kernels(fake_gpu):
    """On CUDA arrays: the block-sparse kernels (kBlocks = true in their text) with the statuses'
    pointer and strides in ModParams (0 where broadcast); NumPy statuses refused before any launch."""
    def shifted(b, h, i, j):
        return j <= i + 40 * b

    def make(statuses):
        return BlockMask(shifted, (), trace(shifted, "mask"), statuses, 2, None, 100, 100)

    with pytest.raises(TypeError, match="block_mask's statuses must be the same kind of array"):
        cuflash.attention(*QKV, block_mask=make(np.zeros((2, 1, 1, 1), np.int8)))
    assert "options" not in fake_gpu
    on_gpu = _on_the_gpu(np.zeros((2, 1, 1, 1), np.int8), "block_mask")._replace(ptr=8192)
    with pytest.raises(RuntimeError, match="launched"):
        cuflash.attention(*QKV, block_mask=make(on_gpu))
    options = fake_gpu["options"]
    assert options.mods.blocks is on_gpu
    assert options.mods.source == kernel_source(None, trace(shifted, "mask"), blocks=True)
    q = _on_the_gpu(QKV[0])
    forward = _plan.forward(q, q, q, q, options, None, device(227 * 1024, 132, sm90a=True))
    backward = _plan.backward(q, q, q, q, q, q, q, q, None, options, None, device(227 * 1024, sm90a=True))
    for plan in (forward, backward):
        params = _params.ModParams.from_buffer_copy(plan.params)
        assert (params.blocks.status, params.blocks.batch_stride, params.blocks.head_stride,
                params.blocks.row_stride) == (8192, 1, 0, 0)
        assert all("UserMods" in s.kernel.instance for s in plan.steps if isinstance(s.kernel, _plan.Kernel))
    wrong = _on_the_gpu(np.zeros((2, 1, 2, 1), np.int8), "block_mask")
    with pytest.raises(ValueError, match=r"block_mask's statuses must be int8 \(1 or batch 2, 1 or heads 4, 1, 1\)"):
        cuflash.attention(*QKV, block_mask=make(wrong))
    plain = _plan.forward(q, q, q, q, options._replace(mods=options.mods._replace(blocks=None)), None,
                          device(227 * 1024, 132))
    assert not _params.ModParams.from_buffer_copy(plain.params).blocks.status  # (null: None in ctypes)


def test_kernel_source_marks_block_masks():
    mask = trace(documents, "mask", SPECS)
    assert "kBlocks = false" in kernel_source(None, mask) and "kBlocks = true" in kernel_source(None, mask, True)
    with pytest.raises(ValueError, match="block mask comes with its mask_mod"):
        kernel_source(trace(relative_bias, "score", SPECS), None, True)


def test_block_params_layout_matches_the_cuda_struct():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    from .test_compile import struct_layout
    base = _params.ModParams.blocks.offset
    fields = {"blocks.status": base, "blocks.batch_stride": base + 8, "blocks.head_stride": base + 16,
              "blocks.row_stride": base + 24}
    size, offsets = struct_layout("mods.cuh", "ModParams", list(fields))
    assert size == ctypes.sizeof(_params.ModParams) == base + ctypes.sizeof(_params.BlockMaskView)
    assert dict(zip(fields, offsets)) == fields


def test_every_mma_sync_tile_lies_in_one_block():
    for kind in ("forward", "backward", "backward_dkdv", "backward_dq"):
        for tiles in (_plan.KINDS[kind].tiles, _plan.KINDS[kind].extras_tiles or {}):
            for tile in (t for candidates in tiles.values() for t in candidates):
                assert BLOCK_SIZE % tile.block_m == 0 and BLOCK_SIZE % tile.block_n == 0, (kind, tile)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kind,head_dim", KINDS)
def test_block_sparse_variants_compile_without_spills(kind, head_dim, arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    """The variants of test_mod_kernels' compile test (its mods, heavy on purpose), with a block mask."""
    source = kernel_source(trace(relative_bias, "score", SPECS), trace(documents, "mask", SPECS), blocks=True)
    kernel = _plan.kernel(kind, "bfloat16", head_dim, True, True, True, _plan.shared_memory_limit(arch), source)
    assert kernel.instance.endswith(", cuflash::UserMods>") and "kBlocks = true" in kernel.mods
    compiled = _compile.compile_kernel(kernel.source, kernel.instance, arch, prelude=source)
    print(arch, kernel.instance, compiled.resources)
    assert 0 < compiled.resources.registers <= 255
    assert compiled.resources.spill_stores == compiled.resources.spill_loads == 0
