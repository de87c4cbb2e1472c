"""The compile layer without a GPU: a covering sample of the variants builds for
sm_80 and sm_90 with no spills, the cache key follows every source byte, ptxas reports are parsed."""
import ctypes
import re
import shutil
import subprocess
import sys

import pytest

from cuflash import _compile, _plan

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")


def test_covering_sample_compiles_for_sm80_and_sm90_without_spills():
    """Every kernel family and template branch, through the CLI, into the user's kernel
    cache (an edit to any source is a new key, so a compile error cannot hide behind it).
    The full sweep of every variant is CI's own step: `python -m cuflash compile`."""
    result = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--arch", "sm_80,sm_90", "--sample"],
                            capture_output=True, text=True, timeout=1800)
    print(result.stdout[-3000:], result.stderr[-3000:])
    assert result.returncode == 0
    expected = len(_plan.covering_sample(("sm_80", "sm_90")))
    assert f"{expected} variants compiled, 0 spill" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith(("sm_80", "sm_90"))]
    assert len(rows) == expected
    for row in rows:
        arch, regs, smem, spill = row.split()[:4]
        assert 0 < int(regs) <= 255 and int(spill) == 0
        assert float(smem) * 1024 <= _plan.shared_memory_limit(arch)


def test_covering_sample_reaches_every_branch():
    archs = ("sm_80", "sm_90")
    every = [(arch, k) for arch in archs for k in _plan.all_kernels(arch)]
    sample = _plan.covering_sample(archs)
    assert len(sample) < len(every) / 10

    def seen(pairs, *fields):
        return {tuple(getattr(k, f) for f in fields) for _, k in pairs if isinstance(k, _plan.Kernel)}

    for fields in (("kind", "head_dim", "tile"), ("kind", "local", "vectorized", "extras"), ("kind", "dtype")):
        assert seen(sample, *fields) == seen(every, *fields), fields
    assert {(a, k.kind, k.local, k.extras) for a, k in sample if isinstance(k, _plan.Kernel)} == \
           {(a, k.kind, k.local, k.extras) for a, k in every if isinstance(k, _plan.Kernel)}
    assert {(a, k) for a, k in sample if isinstance(k, _plan.Elementwise)} == \
           {(a, k) for a, k in every if isinstance(k, _plan.Elementwise)}


@pytest.fixture
def private_sources(tmp_path, monkeypatch):
    """A copy of cuflash/cuda and an empty cache, both in tmp_path."""
    cuda = tmp_path / "cuda"
    shutil.copytree(_compile.CUDA_DIR, cuda)
    monkeypatch.setattr(_compile, "CUDA_DIR", cuda)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    _compile._sources.cache_clear()
    yield cuda
    _compile._sources.cache_clear()


def test_an_edited_header_recompiles(private_sources, monkeypatch):
    kernel = _plan.kernel("forward", "float16", 64, local=True, vectorized=True, extras=False,
                          shared_limit=_plan.shared_memory_limit("sm_80"))
    runs = []
    real = _compile.run_nvrtc
    monkeypatch.setattr(_compile, "run_nvrtc", lambda *a: runs.append(a) or real(*a))

    first = _compile.compile_kernel("fwd.cu", kernel.instance, "sm_80")
    again = _compile.compile_kernel("fwd.cu", kernel.instance, "sm_80")
    assert len(runs) == 1 and again == first  # the second came from the disk cache

    header = private_sources / "softmax.cuh"
    header.write_text(header.read_text() + "\n// an edit\n")
    _compile._sources.cache_clear()
    _compile.compile_kernel("fwd.cu", kernel.instance, "sm_80")
    assert len(runs) == 2
    _compile.compile_kernel("fwd.cu", kernel.instance, "sm_90")  # another arch is another key
    assert len(runs) == 3
    assert first.cubin[:4] == b"\x7fELF" and first.lowered_name.startswith("_ZN7cuflash17attention_forward")


def test_compile_errors_carry_the_nvrtc_log(private_sources):
    (private_sources / "fwd.cu").write_text((private_sources / "fwd.cu").read_text() + "\nthis is not C++;\n")
    _compile._sources.cache_clear()
    with pytest.raises(RuntimeError, match="(?s)NVRTC failed to compile .*error: expected a declaration"):
        _compile.compile_kernel("fwd.cu", _plan.all_kernels("sm_80")[0].instance, "sm_80")


def test_resources_from_ptxas_log():
    log = ("ptxas         .     24 bytes stack frame, 56 bytes spill stores, 48 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert _compile.Resources.from_log(log) == _compile.Resources(255, 56, 48, 24)
    with pytest.raises(RuntimeError, match="no ptxas resource report"):
        _compile.Resources.from_log("nothing here")


def test_tile_table_fits_every_arch():
    for arch in _plan.SHARED_MEMORY_LIMIT:
        for kernel in _plan.all_kernels(arch):
            assert kernel.shared_bytes <= _plan.shared_memory_limit(arch)


def _leaves(struct, prefix=""):
    """(dotted name, C member expression) of every scalar field, nested structs (and their
    bases' fields) walked."""
    from cuflash._params import ArrayView
    fields = [field for base in reversed(struct.__mro__) for field in base.__dict__.get("_fields_", ())]
    for name, kind in fields:
        if name.startswith("_"):  # padding
            continue
        if kind is ArrayView:
            yield prefix + name, f"{prefix}{name}.ptr"
        elif issubclass(kind, ctypes.Array) and issubclass(kind._type_, ctypes.Structure):  # its first's first
            yield prefix + name, f"{prefix}{name}[0].{kind._type_._fields_[0][0]}"
        elif issubclass(kind, ctypes.Array):  # its first element
            yield prefix + name, f"{prefix}{name}[0]"
        elif isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            yield from _leaves(kind, f"{prefix}{name}.")
        else:
            yield prefix + name, prefix + name


def struct_layout(header: str, struct: str, members: list[str]) -> tuple[int, list[int]]:
    """The size of the CUDA struct cuflash::<struct> (declared in header) and the byte offset
    of each member expression, as NVRTC lays them out: it has no offsetof, so one probe
    kernel per member reads it and the PTX says from where."""
    probes = [f'extern "C" __global__ void probe_{i}(const cuflash::{struct} p, long long* out) '
              f"{{ out[0] = (long long)p.{member}; }}" for i, member in enumerate(members)]
    nvrtc = _compile._nvrtc()
    headers = {n: t for n, t in _compile._sources().items() if n.endswith(".cuh")}
    source = f'#include "{header}"\n' + "\n".join(probes) + "\n"
    prog = nvrtc.createProgram(source, "layout.cu", list(headers.values()), [n.encode() for n in headers])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_80", "--std=c++17"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    size = re.search(r"\.param \.align \d+ \.b8 probe_0_param_0\[(\d+)\]", ptx)
    assert size, "no parameter size in the PTX"
    offsets = []
    for i, member in enumerate(members):
        load = re.search(rf"ld\.param\.\w+\s+%\w+, \[probe_{i}_param_0(?:\+(\d+))?\]", ptx)
        assert load, f"no load of {member} in the PTX"
        offsets.append(int(load[1] or 0))
    return int(size[1]), offsets


@pytest.mark.parametrize("struct,header", [("Params", "params.cuh"), ("DecodeParams", "decode/decode_params.cuh"),
                                           ("MergeParams", "decode/decode_params.cuh"),
                                           ("Sm90Params", "sm90/fwd_params.cuh"),
                                           ("Sm90ModParams", "sm90/fwd_params.cuh"),
                                           ("Sm90BackwardParams", "sm90/bwd_params.cuh"),
                                           ("Sm90BackwardModParams", "sm90/bwd_params.cuh")])
def test_params_layout_matches_the_cuda_struct(struct, header):
    """cuflash._params' structs must lay out exactly like their CUDA structs."""
    from cuflash import _params
    cls = getattr(_params, struct)
    leaves = list(_leaves(cls))
    size, offsets = struct_layout(header, struct, [member for _, member in leaves])
    assert size == ctypes.sizeof(cls)
    for (name, _), offset in zip(leaves, offsets):
        assert offset == _plan.field_offset(cls, name), name


def test_cubin_is_the_whole_elf_file():
    """NVRTC's cubin must come back byte for byte (CuPy's getCUBIN drops the last
    byte; nvdisasm and other ELF readers refuse the short file)."""
    import struct
    cubin = _compile.run_nvrtc("fwd.cu", _plan.all_kernels("sm_90")[0].instance, ("--gpu-architecture=sm_90",)
                                + _compile.OPTIONS).cubin
    ph_offset, sh_offset = struct.unpack_from("<QQ", cubin, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", cubin, 0x36)
    assert cubin[:4] == b"\x7fELF"
    assert len(cubin) == max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
