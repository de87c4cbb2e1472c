"""Programmable attention's kernel side without a GPU: the mod variants of each mma.sync kernel
kind compile for sm_80 and sm_90, and the sm_90a ones for sm_90a, with no spills, their
argument lays out as the CUDA struct, the planner sends calls with mods to their kernels and
keys them by the functions' text, and every error is raised before any launch."""
import ctypes

import numpy as np
import pytest

import cuflash
from cuflash import _arrays, _compile, _kernels, _params, _plan, api, experiment, mod
from cuflash.mod import TensorSpec, index_ranges, kernel_source, trace

from .test_compile import struct_layout
from .test_plan import device

SPECS = (TensorSpec(0, None, (4, 33), "float32"), TensorSpec(1, None, (2, 300), "int64"),
         TensorSpec(2, None, (4,), "bfloat16"), TensorSpec(3, None, (2, 300), "bool"),
         TensorSpec(4, None, (4,), "float16"))


def relative_bias(s, b, h, q_idx, kv_idx, bias, doc, slopes, prefix, half):
    distance = mod.minimum(mod.maximum(q_idx - kv_idx, -16), 16)
    return 8.0 * mod.tanh(s / 8.0) + bias[h, distance + 16] - slopes[h] * abs(q_idx - kv_idx) * half[h]


def documents(b, h, q_idx, kv_idx, bias, doc, slopes, prefix, half):
    return (doc[b, q_idx] == doc[b, kv_idx]) | prefix[b, kv_idx]


SOURCE = kernel_source(trace(relative_bias, "score", SPECS), trace(documents, "mask", SPECS))
# One variant of each kernel kind that takes mods (the one-pass backward in its extras tiles, 64 x 64).
KINDS = (("forward", 128), ("backward_dkdv", 128), ("backward_dq", 128), ("backward", 128), ("backward", 256))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kind,head_dim", KINDS)
def test_mod_variants_compile_without_spills(kind, head_dim, arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    kernel = _plan.kernel(kind, "bfloat16", head_dim, True, True, True, _plan.shared_memory_limit(arch), SOURCE)
    assert kernel.instance.endswith(", cuflash::UserMods>")
    compiled = _compile.compile_kernel(kernel.source, kernel.instance, arch, prelude=SOURCE)
    print(arch, kernel.instance, compiled.resources)
    assert 0 < compiled.resources.registers <= 255
    assert compiled.resources.spill_stores == compiled.resources.spill_loads == 0


def t5_bias(s, b, h, q_idx, kv_idx, table, doc_q, doc_k):
    return s + table[h, mod.minimum(mod.maximum(q_idx - kv_idx, -16), 16) + 16]


def same_document(b, h, q_idx, kv_idx, table, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


T5_SPECS = (TensorSpec(0, None, (4, 33), "float32"), TensorSpec(1, None, (2, 300), "int32"),
            TensorSpec(2, None, (2, 300), "int64"))
T5_DOCUMENTS = kernel_source(trace(t5_bias, "score", T5_SPECS), trace(same_document, "mask", T5_SPECS))
# The sm_90a kernels with mods: a T5 bias and a document mask, with a block mask or not, and the
# backward with SOURCE's heavier functions (the forward's 64-key tiles spill a few registers
# with those where no block mask splits the score and mask passes); the forward's tile is the
# one experiment.override(sm90_mods_tiles=...) gives it, the backward's d 128 (the head dims
# it takes mods at).
SM90 = (("forward", 64, True, T5_DOCUMENTS), ("forward", 128, False, T5_DOCUMENTS.replace("kBlocks = false",
                                                                                          "kBlocks = true")),
        ("backward", 128, False, SOURCE), ("backward", 128, True, T5_DOCUMENTS.replace("kBlocks = false",
                                                                                      "kBlocks = true")))


@pytest.mark.parametrize("kind,head_dim,local,source", SM90, ids=[f"{k}-{d}-{c}" for k, d, c, _ in SM90])
def test_sm90_mod_variants_compile_without_spills(kind, head_dim, local, source):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    if kind == "forward":
        kernel = _plan.Sm90Forward("bfloat16", head_dim, local, True, 64, 3, 2, source, "kBlocks = true" in source)
    else:
        kernel = _plan.Sm90Backward.of("bfloat16", head_dim, local, True, source)
    assert kernel.instance.endswith(", cuflash::UserMods>") and kernel.extras
    compiled = _compile.compile_kernel(kernel.source, kernel.instance, "sm_90a", prelude=source)
    assert compiled.resources.spill_stores == compiled.resources.spill_loads == 0


# mask_mod alone with a block mask: the sm_90a kernels' plain instances (the hidden scores -inf
# before the exp, in partial blocks only), both head dims, causal or not.
# A mask that loads from its tensors (the forward's SM90_MASK_TENSOR_TILES) and one of indices
# only (at d 64 three consumers' 160 registers: SM90_MASK_TILES).
MASK_ONLY = kernel_source(None, trace(same_document, "mask", T5_SPECS), True)
INDEX_MASK = kernel_source(None, trace(lambda b, h, q_idx, kv_idx, *tensors: kv_idx <= q_idx, "mask", T5_SPECS),
                           True)


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("source", [MASK_ONLY, INDEX_MASK], ids=["loads", "indices"])
def test_sm90_plain_instances_take_a_mask_mod_alone_without_spills(kind, head_dim, local, source):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    if kind == "forward":
        kernel = _plan.Sm90Forward.of("bfloat16", head_dim, local, False, False, source, True,
                                      mod_tensors=source is MASK_ONLY)
        assert kernel.consumers == (3 if head_dim == 64 and source is INDEX_MASK else 2)
    else:
        kernel = _plan.Sm90Backward.of("bfloat16", head_dim, local, False, source)
    assert kernel.instance.endswith(", false, cuflash::UserMods>") and not kernel.extras
    compiled = _compile.compile_kernel(kernel.source, kernel.instance, "sm_90a", prelude=source)
    assert compiled.resources.spill_stores == compiled.resources.spill_loads == 0


def test_mod_params_layout_matches_the_cuda_struct():
    """ModParams is Params then the mod tensors, as cuda/mods.cuh declares them (NVRTC has no
    offsetof: each probe reads one field, and the PTX says from where)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    tensor = ctypes.sizeof(_params.ModTensor)
    base = _params.ModParams.tensors.offset
    fields = {"tile_group": _params.Params.tile_group.offset, "tensors[0].ptr": base,
              "tensors[1].ptr": base + tensor,
              "tensors[2].stride[3]": base + 2 * tensor + _params.ModTensor.stride.offset + 24,
              "tensors[7].size[2]": base + 7 * tensor + _params.ModTensor.size.offset + 8}
    size, offsets = struct_layout("mods.cuh", "ModParams", list(fields))
    assert size == ctypes.sizeof(_params.ModParams)
    assert base == ctypes.sizeof(_params.Params)
    assert dict(zip(fields, offsets)) == fields


def _on_the_gpu(x, name="q", device=0):
    """A NumPy array described as a CuPy array on a GPU (nothing reads its memory here)."""
    return _moved_to_the_gpu(_arrays.inspect(x, name), name, device)


def _moved_to_the_gpu(info: _arrays.ArrayInfo, name: str, device: int = 0) -> _arrays.ArrayInfo:
    dtype = "float16" if info.dtype == "float32" and name in ("q", "k", "v", "dout") else info.dtype
    return info._replace(framework="cupy", device=device, dtype=dtype, ptr=4096)


CALL_ARRAYS = ("q", "k", "v", "dout", "out", "lse", "dlse")  # the arrays a call's own arguments name


@pytest.fixture
def fake_gpu(monkeypatch):
    """cuflash's calls see CuPy arrays on GPU 0 (mod tensors passed as ArrayInfo, or as NumPy
    arrays: another kind); launching raises. Returns what reached the planner."""
    return pretend_gpu(monkeypatch)


def pretend_gpu(monkeypatch) -> dict:
    """fake_gpu's work, for other modules' fixtures."""
    reached = {}

    def never(q, k, v, out, options, varlen):
        reached["options"] = options
        raise RuntimeError("launched")

    described = _arrays.inspect

    def inspect(x, name):  # (the call's arrays on GPU 0; mod tensors and block masks as they are)
        info = described(x, name)
        return _moved_to_the_gpu(info, name) if name in CALL_ARRAYS else info

    monkeypatch.setattr(_arrays, "inspect", inspect)
    monkeypatch.setattr(api._arrays, "Framework", lambda q: type("F", (), {"empty": lambda *a: q, "stream": 0})())
    monkeypatch.setattr(_kernels, "forward_launcher", never)
    monkeypatch.setattr(_kernels, "backward_launcher", lambda *a: never(*a[:4], a[-2], a[-1]))
    return reached


QKV = tuple(np.ones((2, 100, 4, 128), np.float32) for _ in range(3))


def test_mod_calls_plan_their_kernels_keyed_by_their_text(fake_gpu):
    """The mma.sync kernels (on a Hopper GPU too: SM90_MODS_TILES is empty; where dq_accum
    is given its backward takes the sm_90a kernel: test_sm90_backward), compiled with the
    functions' text, their mod tensors after Params."""
    bias = _on_the_gpu(np.zeros((4, 199), np.float32), "bias")
    with pytest.raises(RuntimeError, match="launched"):
        cuflash.attention(*QKV, causal=True, score_mod=lambda s, b, h, i, j, t: s + t[h, i - j + 99],
                          mod_tensors=(bias,))
    options = fake_gpu["options"]
    assert options.extras and options.mods.tensors == (bias,)
    q = _on_the_gpu(QKV[0])
    for sm90a, routed in ((False, False), (True, False), (True, True)):  # (no dq_accum: the two-kernel backward)
        sm90 = sm90a and routed  # (experiment.override sends mods to the sm_90a forward)
        with experiment.override(sm90_mods_tiles={128: (64, 3, 2)} if routed else None):
            forward = _plan.forward(q, q, q, q, options, None, device(227 * 1024, 132, sm90a=sm90a))
        backward = _plan.backward(q, q, q, q, q, q, q, q, None, options, None, device(227 * 1024, sm90a=sm90a))
        tiled = [s.kernel for s in forward.steps + backward.steps if not isinstance(s.kernel, _plan.Elementwise)]
        kinds = [getattr(k, "kind", type(k).__name__) for k in tiled]
        assert kinds == ["Sm90Forward" if sm90 else "forward", "backward_dq", "backward_dkdv"]
        assert all(k.mods == options.mods.source and "UserMods" in k.instance for k in tiled)
        assert forward.struct is (_params.Sm90ModParams if sm90 else _params.ModParams)
        assert backward.struct is _params.ModParams
        for plan in (forward, backward):  # the launcher finds every pointer of Params where Params has it
            base = _params.Sm90Params if plan.struct is _params.Sm90ModParams else _params.Params
            inside = tuple(name for name in plan.pointers if not sm90 or name.startswith("p."))
            assert _plan.pointer_offsets(plan.struct, inside) == _plan.pointer_offsets(base, inside)
        params = forward.struct.from_buffer_copy(forward.params)
        params = params.p if sm90 else params
        assert (params.tensors[0].ptr, list(params.tensors[0].size[:2]), list(params.tensors[0].stride[:2])) == \
            (4096, [4, 199], [199, 1])
    plain = _plan.forward(q, q, q, q, options._replace(mods=None), None, device(227 * 1024, 132))
    assert plain.struct is _params.Params and plain.steps[0].kernel.mods == ""
    assert "UserMods" not in plain.steps[0].kernel.instance
    assert not _kernels._cacheable(options, None)  # (planned each call, as ALiBi)


def test_the_compile_cache_keys_kernels_by_the_mod_text(monkeypatch, tmp_path):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    compiled = []

    def fake_nvrtc(source, instance, options, prelude=""):
        compiled.append(prelude)
        return _compile.Compiled(b"\x7fELF" + prelude.encode(), "kernel", _compile.Resources(32, 0, 0, 0), (12, 0))

    monkeypatch.setattr(_compile, "run_nvrtc", fake_nvrtc)
    first, second = SOURCE, kernel_source(None, trace(documents, "mask", SPECS))
    for prelude in (first, second, first, "", ""):
        _compile.compile_kernel("fwd.cu", "cuflash::attention_forward<x>", "sm_80", prelude=prelude)
    assert compiled == [first, second, ""]


def test_equal_functions_share_their_text_whatever_the_shapes():
    shorter = tuple(s._replace(shape=(3, 17)) if s.position == 0 else s for s in SPECS)
    assert kernel_source(trace(relative_bias, "score", shorter), None) == \
        kernel_source(trace(relative_bias, "score", SPECS), None)
    assert kernel_source(trace(lambda s, b, h, i, j, *t: s * 2, "score", SPECS), None) != \
        kernel_source(trace(lambda s, b, h, i, j, *t: s * 3, "score", SPECS), None)


def test_index_ranges_follow_the_call_positions():
    domain = {"b": (0, 1), "h": (0, 3), "q_idx": (0, 99), "kv_idx": (0, 99)}
    spec = (TensorSpec(0, "bias", (4, 199), "float32"),)
    index_ranges(trace(lambda s, b, h, i, j, t: s + t[h, i - j + 99], "score", spec), domain)
    with pytest.raises(IndexError, match=r"index 1 of mod tensor 't' .* got values from -1 to 197"):
        index_ranges(trace(lambda s, b, h, i, j, t: s + t[h, i - j + 98], "score", spec), domain)
    clipped = trace(lambda s, b, h, i, j, t: s + t[h % 4, mod.minimum(abs(i - j), 198) + 0 * (b // 2)], "score",
                    spec)
    index_ranges(clipped, {**domain, "h": (0, 31), "q_idx": (0, 10**6)})
    doc = (TensorSpec(0, "doc", (2, 100), "int32"), TensorSpec(1, "table", (5,), "float32"))
    index_ranges(trace(lambda s, b, h, i, j, d, t: s + t[d[b, i]], "score", doc), domain)  # (clamped in the kernel)
    with pytest.raises(ValueError, match="beyond int32"):
        index_ranges(trace(lambda b, h, i, j: i * j * j > 0, "mask"), {**domain, "q_idx": (0, 2**20),
                                                                        "kv_idx": (0, 2**20)})


def test_errors_name_the_argument_before_any_launch(fake_gpu):
    def score(s, b, h, i, j, t):
        return s + t[h]

    slopes = np.zeros(4, np.float32)
    cases = [
        ((slopes,), TypeError, r"mod_tensors\[0\] must be the same kind of array on the same device as q"),
        ((_on_the_gpu(slopes, "t", device=1),), TypeError, r"mod_tensors\[0\] must be the same kind of array"),
        ((_on_the_gpu(slopes.astype(np.uint8), "t"),), TypeError, r"mod_tensors\[0\] must have a dtype among"),
        ((_on_the_gpu(slopes, "t"),) * 9, ValueError, "at most 8 mod tensors"),
        ((_on_the_gpu(np.zeros((4, 1, 1, 1, 1), np.float32), "t"),), ValueError, "at most 4 dimensions"),
        ((_on_the_gpu(np.zeros((4, 0), np.float32), "t"),), ValueError, r"sizes in \[1, 2\*\*31\)"),
        ((_on_the_gpu(slopes[:2], "t"),), IndexError,
         r"index 0 of mod tensor 't' \(mod_tensors\[0\]\) \(shape \(2,\)\)"),
    ]
    for tensors, error, message in cases:
        with pytest.raises(error, match=message):
            cuflash.attention(*QKV, score_mod=score, mod_tensors=tensors)
    with pytest.raises(TypeError, match="used in Python control flow"):
        cuflash.attention(*QKV, score_mod=lambda s, b, h, i, j: s if s > 0 else -s)
    with pytest.raises(ValueError, match="beyond int32"):
        cuflash.attention(*QKV, mask_mod=lambda b, h, i, j: i * 300000 * j > 0)
    assert "options" not in fake_gpu  # nothing reached the launch


def test_half_precision_mod_tensors_on_the_numpy_path():
    """float16 and bfloat16 mod tensors (the GPU reads them as float32) on the NumPy path."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 9, 2, 16)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.25, 0.5], np.float32)
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (NumPy bfloat16)")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        out = cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j, t: s - t[h] * abs(i - j),
                                mod_tensors=(slopes.astype(dtype),))
        np.testing.assert_allclose(out, cuflash.attention(q, k, v, alibi_slopes=slopes), atol=1e-6)
