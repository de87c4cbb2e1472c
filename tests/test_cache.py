"""The kernel cache without a GPU: an entry is checked before it is loaded (a bad one
is reported once, removed and rebuilt), written whole with the umask's mode, and built
once by processes that need it at once; a GPU below sm_80 is refused in one line."""
import hashlib
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from cuflash import _compile, _plan

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda12/cuda13 extra) is not installed")

KERNEL = _plan.Elementwise("backward_preprocess", "float16")  # the quickest variant to compile


@pytest.fixture(scope="module")
def compiled():
    """The variant compiled by NVRTC, once for the module."""
    return _compile.run_nvrtc(KERNEL.source, KERNEL.instance, ("--gpu-architecture=sm_80",) + _compile.OPTIONS)


@pytest.fixture
def cache(tmp_path, monkeypatch, compiled):
    """An empty cache in tmp_path; each NVRTC run is counted (and answered with ``compiled``)."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    monkeypatch.setattr(_compile, "run_nvrtc", lambda *args: runs.append(args) or compiled)
    return types.SimpleNamespace(dir=tmp_path / "cache", runs=runs)


def _compile_kernel():
    return _compile.compile_kernel(KERNEL.source, KERNEL.instance, "sm_80")


def _edit_metadata(change):
    def edit(cubin, meta):
        data = json.loads(meta.read_text())
        change(data)
        meta.write_text(json.dumps(data))
    return edit


def _flip_a_byte(cubin, meta):
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated cubin": lambda cubin, meta: cubin.write_bytes(cubin.read_bytes()[:1000]),
    "flipped byte in the cubin": _flip_a_byte,
    "garbage metadata": lambda cubin, meta: meta.write_bytes(b"\xff{not json"),
    "metadata not an object": lambda cubin, meta: meta.write_text("[1, 2, 3]"),
    "metadata without the hash": _edit_metadata(lambda data: data.pop("cubin_sha256")),
    "metadata without the name": _edit_metadata(lambda data: data.pop("lowered_name")),
    "metadata with odd resources": _edit_metadata(lambda data: data.update(resources={"registers": 1})),
    "metadata with a wrong hash": _edit_metadata(lambda data: data.update(
        cubin_sha256=hashlib.sha256(b"another cubin").hexdigest())),
    "metadata of another key": _edit_metadata(lambda data: data.update(key="0" * 64)),
    "cubin without metadata": lambda cubin, meta: meta.unlink(),
    "metadata without cubin": lambda cubin, meta: cubin.unlink(),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS)
def test_a_bad_entry_is_reported_once_removed_and_rebuilt(cache, compiled, corrupt):
    assert _compile_kernel() == compiled and len(cache.runs) == 1
    (meta,) = cache.dir.glob("*.json")
    corrupt(meta.with_suffix(".cubin"), meta)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _compile_kernel()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert meta.stem in str(caught[0].message)
    assert again == compiled and len(cache.runs) == 2  # rebuilt, the bad entry never loaded

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compile_kernel() == compiled  # the rebuilt entry is sound
    assert len(cache.runs) == 2


def test_a_sound_entry_carries_its_cubins_hash(cache, compiled):
    _compile_kernel()
    (meta,) = cache.dir.glob("*.json")
    data = json.loads(meta.read_text())
    assert data["cubin_sha256"] == hashlib.sha256(meta.with_suffix(".cubin").read_bytes()).hexdigest()
    assert data["key"] == meta.stem and data["arch"] == "sm_80" and data["instance"] == KERNEL.instance
    assert _compile.verify_entry(meta.with_suffix("")) is None


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o022, 0o644)])
def test_cache_files_follow_the_umask(cache, umask, mode):
    old = os.umask(umask)
    try:
        _compile_kernel()
    finally:
        os.umask(old)
    files = sorted(cache.dir.iterdir())
    assert [p.suffix for p in files] == [".cubin", ".json", ".lock"]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}
    assert cache.dir.stat().st_mode & 0o777 == mode | 0o111


def test_an_interrupted_write_leaves_no_file_behind(cache, monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _compile_kernel()
    assert [p.suffix for p in cache.dir.iterdir()] == [".lock"]


def test_an_unwritable_cache_does_not_stop_the_computation(cache, compiled, tmp_path, monkeypatch):
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "a file" / "cache"))  # even root cannot make it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compile_kernel() == compiled
        assert _compile_kernel() == compiled
    assert len(cache.runs) == 2


RACER = """
import hashlib, pathlib, sys, time
from unittest import mock
from cuflash import _compile
ready, instance = pathlib.Path(sys.argv[1]), sys.argv[2]
_compile.nvrtc_version()  # load NVRTC before the start line
runs, real = [], _compile.run_nvrtc
ready.touch()
while len(list(ready.parent.glob("ready-*"))) < 2:
    time.sleep(0.01)
with mock.patch.object(_compile, "run_nvrtc", lambda *args: runs.append(args) or time.sleep(1) or real(*args)):
    compiled = _compile.compile_kernel("bwd.cu", instance, "sm_80")  # (a long compile)
print("compiled" if runs else "loaded", hashlib.sha256(compiled.cubin).hexdigest())
"""


def test_processes_needing_one_variant_at_once_compile_it_once(tmp_path):
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(tmp_path / "cache"))
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / f"ready-{i}"), KERNEL.instance],
                               stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[1])
              for i in range(2)]
    outputs = [racer.communicate(timeout=120)[0].split() for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    assert sorted(how for how, _ in outputs) == ["compiled", "loaded"]
    assert outputs[0][1] == outputs[1][1]


def test_a_gpu_below_sm80_is_refused_in_one_line(monkeypatch):
    with pytest.raises(RuntimeError) as refused:
        _compile.check_supported("Tesla T4", 7, 5)
    assert str(refused.value) == ("cuflash's kernels need compute capability 8.0 or newer (A100, RTX 30xx, L4/L40, "
                                  "H100/H200, ...); this GPU, Tesla T4, has 7.5")
    _compile.check_supported("NVIDIA A100", 8, 0)

    from cuflash import _device, _driver
    gpu = {"name": "Tesla V100-SXM2-16GB", _driver.COMPUTE_CAPABILITY_MAJOR: 7, _driver.COMPUTE_CAPABILITY_MINOR: 0}
    monkeypatch.setattr(_driver, "attribute", lambda device, attr: gpu.get(attr, 0))
    monkeypatch.setattr(_driver, "name", lambda device: gpu["name"])
    monkeypatch.setattr(_driver, "version", lambda: 12090)
    _device._read.cache_clear()  # (the stand-in GPUs' facts, read afresh; the real ones after)
    try:
        with pytest.raises(RuntimeError, match=r"this GPU, Tesla V100-SXM2-16GB, has 7\.0$"):
            _compile.device_arch(0)
        _device._read.cache_clear()
        gpu.update({"name": "NVIDIA B200", _driver.COMPUTE_CAPABILITY_MAJOR: 10, _driver.COMPUTE_CAPABILITY_MINOR: 0})
        assert _compile.device_arch(0) == "sm_100"
    finally:
        _device._read.cache_clear()


def test_an_entry_of_another_nvrtc_is_loaded_and_refreshed_by_compile(monkeypatch, tmp_path):
    """A cache hit does not load NVRTC to learn its version (the key leaves it out); the
    entry records the version that compiled it, and compile(refresh=True), what
    ``python -m cuflash compile`` runs, compiles again an entry of another version."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    runs = []
    monkeypatch.setattr(_compile, "run_nvrtc", lambda *args: runs.append(args) or _compile.Compiled(
        b"\x7fELF cubin", "lowered", _compile.Resources(32, 0, 0, 0), (11, 8)))
    monkeypatch.setattr(_compile, "nvrtc_version", lambda: (12, 9))
    first = _compile.compile_kernel(KERNEL.source, KERNEL.instance, "sm_80")
    assert first.nvrtc == (11, 8) and len(runs) == 1
    again = _compile.compile_kernel(KERNEL.source, KERNEL.instance, "sm_80")
    assert again == first and len(runs) == 1  # loaded, whatever NVRTC is installed
    _compile.compile_kernel(KERNEL.source, KERNEL.instance, "sm_80", refresh=True)
    assert len(runs) == 2
