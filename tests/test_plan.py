"""The planner on its own: plans from shapes, dtypes and options, with no GPU and no
compiler, and its shared-memory sizes held against the kernels' own layouts."""
import ast
from pathlib import Path

import pytest

from cuflash import _compile, _device, _options, _plan
from cuflash._arrays import ArrayInfo, contiguous_strides
from cuflash._params import DecodeParams, Params


def info(shape, dtype="bfloat16", ptr=1 << 20) -> ArrayInfo:
    shape = tuple(shape)
    return ArrayInfo(None, "cupy", ptr, shape, contiguous_strides(shape), dtype, 0)


def device(shared_limit=_plan.shared_memory_limit("sm_90"), multiprocessors=0, **flags) -> _device.Device:
    """A device's facts as the planner takes them (sm90a, clusters, dependent_launches,
    resident_ctas as given)."""
    return _device.Device("stand-in", (9, 0), shared_limit, multiprocessors, 12090, **flags)


def dense(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype="bfloat16"):
    q = info((batch, seqlen_q, nheads, head_dim), dtype)
    k, v = (info((batch, seqlen_k, nheads_kv, head_dim), dtype) for _ in range(2))
    return q, k, v


@pytest.fixture
def no_compiler(monkeypatch):
    """Planning that reached for the compiler would fail here."""
    def refuse(*args, **kwargs):
        raise AssertionError("the planner compiled a kernel")
    monkeypatch.setattr(_compile, "compile_kernel", refuse)
    monkeypatch.setattr(_compile, "load_kernel", refuse)


def test_the_planner_imports_no_compiler_driver_or_framework():
    """What the planner's modules import when they run (type hints aside): each other and
    the argument layouts, no more; and no module of the package imports one that imports it."""
    package = Path(_plan.__file__).parent
    imports = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = [node for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
        hidden = {id(n) for block in typing_only for n in ast.walk(block)}
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in hidden:
                if node.level == 1 and node.module is None:  # from . import a, b
                    found |= {a.name for a in node.names}
                elif node.level == 1:
                    found.add(node.module)
                elif node.level:
                    found.add("." * (node.level - 1) + node.module)
                else:
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        imports[path.stem] = found
    outside = {name for found in imports.values() for name in found if name not in imports}
    assert {name for name in outside if name.startswith(".")} == {"._params"}
    assert not {"cupy", "torch", "jax"} & {name.split(".")[0] for name in outside}

    def reaches(start, seen=()):
        return {m for m in imports.get(start, ()) if m in imports} | {
            r for m in imports.get(start, ()) if m in imports and m not in seen for r in reaches(m, (*seen, start))}

    assert not [m for m in imports if m != "__init__" and m in reaches(m)], "an import circle"


def test_the_checks_take_what_the_planner_plans():
    """The checks (_options) come before the planner and import none of it: their head dims
    and GPU dtypes are the planner's."""
    assert _options.MAX_HEAD_DIM == _plan.MAX_HEAD_DIM
    assert set(_options.GPU_DTYPES) == set(_plan.DTYPES)


@pytest.mark.parametrize("causal", [False, True])
def test_a_forward_plan(no_compiler, causal):
    q, k, v = dense(3, 1000, 777, 8, 2, 128)
    options = _options.make_options(q, k, causal, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    plan = _plan.forward(q, k, v, info(q.shape), options, None, device(multiprocessors=132))
    (step,) = plan.steps
    tile = _plan.KINDS["forward"].tiles[128][0]
    assert step.kernel == _plan.Kernel("forward", "bfloat16", 128, tile, causal, True, False)
    assert step.grid == (-(-1000 // tile.block_m), 8, 3)
    p = Params.from_buffer_copy(plan.params)
    assert p.tile_group == 24  # (3 x 8 pairs, fewer than a quarter of 132 resident CTAs)
    assert (p.seqlen_q, p.seqlen_k, p.nheads, p.heads_per_kv, p.headdim) == (1000, 777, 8, 4, 128)
    assert (p.window_left, p.window_right) == ((-1, 0) if causal else (-1, -1))
    assert p.q.row_stride == 8 * 128 and p.k.batch_stride == 777 * 2 * 128
    assert not p.q.ptr and not p.lse  # pointers come at launch
    assert plan.pointers == _plan.FORWARD_POINTERS


@pytest.mark.parametrize("head_dim,deterministic,softcap,kinds", [
    (128, False, 0.0, ["backward_preprocess", "backward", "backward_convert_dq"]),
    (128, True, 0.0, ["backward_preprocess", "backward_dq", "backward_dkdv"]),
    (64, False, 5.0, ["backward_preprocess", "backward", "backward_convert_dq"]),
    (64, True, 5.0, ["backward_preprocess", "backward_dq", "backward_dkdv"]),
    (256, False, 5.0, ["backward_preprocess", "backward", "backward_convert_dq"]),
])
def test_a_backward_plan(no_compiler, head_dim, deterministic, softcap, kinds):
    q, k, v = dense(2, 300, 301, 4, 2, head_dim)
    options = _options.make_options(q, k, True, None, (-1, -1), softcap, None, 0.0, None, 0, backward=True)
    work = _plan.backward_workspace(q.shape, deterministic, options.extras)
    accum = info(work["dq_accum"][0], "float32") if "dq_accum" in work else None
    plan = _plan.backward(info(q.shape), q, k, v, info(q.shape), info(q.shape), info(k.shape), info(v.shape), accum,
                          options, None, device(multiprocessors=132))
    assert [s.kernel.kind for s in plan.steps] == kinds
    assert plan.pointers == _plan.BACKWARD_POINTERS[:-1 if accum is not None else -2]  # (no dq_semaphore)


def test_plans_fit_the_shared_memory_they_are_given(no_compiler):
    """The same call on a GPU with less shared memory gets a smaller tile, never one that
    does not fit."""
    q, k, v = dense(1, 512, 512, 4, 4, 256)
    options = _options.make_options(q, k, False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    for arch in ("sm_90", "sm_80", "sm_86"):
        limit = _plan.shared_memory_limit(arch)
        (step,) = _plan.forward(q, k, v, info(q.shape), options, None, device(limit)).steps
        assert step.kernel.shared_bytes <= limit


def test_unaligned_rows_plan_the_scalar_copies(no_compiler):
    q, k, v = dense(1, 64, 64, 2, 2, 64)
    options = _options.make_options(q, k, False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    odd = q._replace(ptr=q.ptr + 2)
    assert not _plan.forward(odd, k, v, info(q.shape), options, None, device(10**6)).steps[0].kernel.vectorized


def test_empty_calls_plan_no_launch(no_compiler):
    q, k, v = dense(0, 10, 10, 2, 2, 64)
    options = _options.make_options(q, k, False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    assert _plan.forward(q, k, v, info(q.shape), options, None, device(10**6)).steps == ()


def test_planned_shared_memory_is_the_kernels_own_layout():
    """For every variant of every arch, the planner's shared-memory size equals the
    kBytes of the layout the kernel carves its shared memory with: NVRTC compiles one
    static_assert per variant (no kernel is instantiated)."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                                reason="NVRTC comes with CuPy (the cuda12/cuda13 extra), not installed")
    variants = {k for arch in _plan.SHARED_MEMORY_LIMIT for k in _plan.all_kernels(arch)
                if isinstance(k, (_plan.Kernel, _plan.Sm90Forward, _plan.Sm90Backward, _plan.Sm90WideBackward))}
    variants.add(_plan.Sm90Forward("bfloat16", 128, False, True, 64, 3, 2, "", blocks=True))  # (its key tiles' bits)
    sources = _compile._sources()
    headers = {n: t for n, t in sources.items() if n.endswith(".cuh")}
    checked = 0
    for source in sorted({k.source for k in variants}):
        asserts = sorted({f"static_assert({k.shared_layout}::kBytes == {k.shared_bytes}, "
                          f"\"{k.shared_layout}: the planner says {k.shared_bytes} bytes\");"
                          for k in variants if k.source == source})
        text = sources[source].decode() + "\n" + "\n".join(asserts) + "\n"
        prog = nvrtc.createProgram(text, source, list(headers.values()), [n.encode() for n in headers])
        try:
            try:
                nvrtc.compileProgram(prog, ["--std=c++17", "--gpu-architecture=compute_80"])
            except nvrtc.NVRTCError:
                pytest.fail(f"{source}:\n{nvrtc.getProgramLog(prog)}")
        finally:
            nvrtc.destroyProgram(prog)
        checked += len(asserts)
    assert checked == len({(k.source, k.shared_layout) for k in variants}) > 20


@pytest.mark.parametrize("num_splits,batch,splits", [(0, 1, 16), (0, 64, 1), (5, 1, 5)])
def test_a_decode_plan(no_compiler, num_splits, batch, splits):
    """The KV-cache call: GQA 32/8 packed four heads a row block, splits from the shapes
    (a CTA for each of 132 multiprocessors, four key tiles a split or more), a merge step
    into the call's output with more than one; a grid that is not split takes the wide
    tile (eight warps, 128 keys)."""
    q = info((batch, 1, 32, 128))
    k_cache, v_cache = info((batch, 4096, 8, 128)), info((batch, 4096, 8, 128))
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    cache = _options.kvcache(arrays, 1000, None, None, None, None, None, True, True, (-1, -1), num_splits)
    options = _options.make_options(q, k_cache, True, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False,
                                    seqlen_k=cache.capacity)
    plan = _plan.decode(q, k_cache, v_cache, None, None, info(q.shape), cache, options, device(multiprocessors=132))
    decode_step, *merge_steps = plan.steps
    assert decode_step.kernel.kind == ("decode_wide" if splits == 1 else "decode")
    assert decode_step.grid == (splits, 8, batch)
    assert decode_step.kernel.tile == (_plan.Tile(16, 128, 8, 2) if splits == 1 else _plan.Tile(16, 64, 4, 2))
    p = DecodeParams.from_buffer_copy(plan.params)
    assert (p.num_splits, p.heads_per_kv, p.seqlen_cache_all, p.capacity) == (splits, 4, 1000, 4096)
    assert (p.window_left, p.window_right) == (-1, 0)
    if splits == 1:
        assert not merge_steps and not plan.workspace
    else:
        (merge_step,) = merge_steps
        assert merge_step.argument == "merge" and merge_step.grid == (batch * 32, 1, 1)
        assert not (decode_step.dependent or merge_step.dependent)  # (before sm_90: one after the other)
        assert dict((n, s) for n, s, _ in plan.workspace) == {"partial_o": (splits, batch, 32, 128),
                                                             "partial_lse": (splits, 32, batch)}
        assert (p.merge.count, p.merge.part_stride, p.merge.lse_part_stride) == (splits, batch * 32 * 128, batch * 32)


@pytest.mark.parametrize("page_size,kind", [(17, "decode"), (20, "decode"), (16, "decode_wide"), (8, "decode_wide"),
                                            (64, "decode_wide"), (256, "decode_wide")])
def test_a_paged_decode_plan_takes_the_wide_tile_where_pages_hold_whole_runs(no_compiler, page_size, kind):
    """An unsplit grid keeps the four-warp kernel over pages copied row by row (shorter
    than the wide tile's 128 keys and not a whole number of its 8-row runs)."""
    q = info((64, 1, 32, 128))
    pool = info((64 * 4096 // page_size, page_size, 8, 128))
    table = info((64, 4096 // page_size), "int32")
    arrays = dict(q=q, k_cache=pool, v_cache=pool)
    cache = _options.kvcache(arrays, 1000, None, None, table, None, None, True, False, (-1, -1), 1)
    options = _options.make_options(q, pool, False, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False,
                                    seqlen_k=cache.capacity)
    plan = _plan.decode(q, pool, pool, None, None, info(q.shape), cache, options, device(multiprocessors=132))
    assert [step.kernel.kind for step in plan.steps] == [kind]


@pytest.mark.parametrize("num_splits,deterministic,batch,clustered", [
    (0, False, 1, True), (16, False, 1, True), (17, False, 1, False), (0, True, 1, False), (1, False, 1, False),
    (0, False, 4, False)])
def test_a_decode_plan_on_a_gpu_with_clusters(no_compiler, num_splits, deterministic, batch, clustered):
    """From sm_90 the splits of a row block (up to 16) run as one thread block cluster and
    merge there, where the grid is a CTA a multiprocessor or less: one launch, no
    workspace. A deterministic call keeps the merge kernel's order; more splits than a
    cluster holds, one split, or two CTAs a multiprocessor (batch 4: 8 splits) plan as
    before, the merge kernel launched as a programmatic dependent of the split kernel."""
    q = info((batch, 1, 32, 128))
    k_cache = info((batch, 4096, 8, 128))
    arrays = dict(q=q, k_cache=k_cache, v_cache=k_cache)
    cache = _options.kvcache(arrays, 1000, None, None, None, None, None, True, True, (-1, -1), num_splits,
                             deterministic)
    options = _options.make_options(q, k_cache, True, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False,
                                    seqlen_k=cache.capacity)
    plan = _plan.decode(q, k_cache, k_cache, None, None, info(q.shape), cache, options,
                        device(multiprocessors=132, clusters=True, dependent_launches=True))
    splits = num_splits or 16
    if clustered:
        (step,) = plan.steps
        assert step.kernel.kind == "decode_cluster" and step.cluster == splits and step.grid == (splits, 8, batch)
        assert step.kernel.instance.endswith(", true>") and not plan.workspace and not step.dependent
    else:
        assert all(step.cluster == 1 and getattr(step.kernel, "kind", "") != "decode_cluster" for step in plan.steps)
        assert [step.dependent for step in plan.steps] == [False, True][:1 if splits == 1 else 2]


def test_clustered_kernels_are_compiled_for_sm_90_only():
    kinds = {arch: {k.kind for k in _plan.all_kernels(arch) if isinstance(k, _plan.Kernel)}
             for arch in ("sm_80", "sm_86", "sm_90")}
    assert "decode_cluster" in kinds["sm_90"] and not {"decode_cluster"} & (kinds["sm_80"] | kinds["sm_86"])


@pytest.mark.parametrize("num_splits,batch,splits,parts", [(0, 1, 16, 16), (0, 16, 1, 16), (3, 1, 3, 16)])
def test_a_deterministic_decode_plan_holds_every_sequence_s_parts(no_compiler, num_splits, batch, splits, parts):
    """deterministic: the workspace holds min(16, tiles / 4) parts whatever the batch, the
    splits (CTAs) at most that many; the kernel cuts each sequence by its own tiles."""
    q = info((batch, 1, 32, 128))
    k_cache = info((batch, 4096, 8, 128))
    arrays = dict(q=q, k_cache=k_cache, v_cache=k_cache)
    cache = _options.kvcache(arrays, 1000, None, None, None, None, None, True, True, (-1, -1), num_splits, True)
    options = _options.make_options(q, k_cache, True, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False,
                                    seqlen_k=cache.capacity)
    plan = _plan.decode(q, k_cache, k_cache, None, None, info(q.shape), cache, options, device(multiprocessors=132))
    p = DecodeParams.from_buffer_copy(plan.params)
    assert (p.deterministic, p.num_splits, p.parts, p.max_parts, p.min_part_tiles) == (1, splits, parts, 16, 4)
    assert plan.steps[0].grid == (splits, 8, batch) and p.merge.count == parts
    assert plan.steps[0].kernel.kind == "decode"  # whatever the batch: the bits may not depend on it
    assert dict((n, s) for n, s, _ in plan.workspace)["partial_o"] == (parts, batch, 32, 128)


@pytest.mark.parametrize("ctas,tiles,small_pages,splits", [
    (8, 64, False, 16), (8, 256, False, 16), (8, 1024, False, 32), (32, 64, False, 8), (32, 256, False, 8),
    (128, 64, False, 1), (128, 64, True, 2), (512, 256, True, 1), (8, 3, False, 1), (8, 20, False, 5),
    (0, 64, False, 1)])
def test_decode_splits(ctas, tiles, small_pages, splits):
    """Two CTAs a multiprocessor where a split keeps 8 tiles, else one; no split below 4
    tiles, none empty; a grid filling half the GPU (with small pages: two CTAs a
    multiprocessor) is not split."""
    assert _plan.decode_splits(ctas, tiles, 132, small_pages) == splits


def test_a_decode_plan_of_no_query_plans_no_launch(no_compiler):
    """(A packed call whose sequences are all empty: no split to choose, nothing to launch.)"""
    from cuflash._options import Varlen
    q, pool = info((0, 8, 64)), info((4, 16, 2, 64))
    cu = info((2,), "int32")
    cache = _options.KVCache(0, None, None, None, info((1, 1), "int32"), 16, 16, 0, None, None, True, 0)
    options = _options.make_options(info((1, 0, 8, 64)), pool, False, None, (-1, -1), 0.0, None, 0.0, None, 0,
                                    backward=False, seqlen_k=0)
    plan = _plan.decode(q, pool, pool, None, None, q, cache, options, device(multiprocessors=132),
                        Varlen(cu, cu, 0, 0))
    assert plan.steps == () and plan.workspace == ()


@pytest.mark.parametrize("kind", ["decode", "decode_wide"])
def test_copy_runs_fill_the_tile(kind):
    """copy_run_rows as copy.cuh's ChunkLanes and load_run count: a whole number of rows a
    thread, the threads' runs covering the tile once."""
    for d in _plan.HEAD_DIM_BUCKETS:
        if not _plan.has_tile(kind, d, False, _plan.shared_memory_limit("sm_90")):
            continue
        k = _plan.kernel(kind, "bfloat16", d, False, True, False, _plan.shared_memory_limit("sm_90"))
        chunks, threads = d // 8, 32 * k.tile.warps
        lanes = min(chunks & -chunks, threads // 8)
        run = _plan.copy_run_rows(d, k.tile)
        assert run >= 2 and run * (threads // lanes) == k.tile.block_n
    assert _plan.copy_run_rows(128, _plan.kernel("decode", "bfloat16", 128, False, True, False, 232448).tile) == 8
