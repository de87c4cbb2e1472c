"""The device's facts (cuflash/_device.py): read from the driver once per device, and what
follows from them for the kernels, on stand-in GPUs (no GPU needed)."""
import pytest

from cuflash import _compile, _device, _driver, _kernels, _plan

H100 = {"name": "NVIDIA H100 80GB HBM3", _driver.COMPUTE_CAPABILITY_MAJOR: 9, _driver.COMPUTE_CAPABILITY_MINOR: 0,
        _driver.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448, _driver.MULTIPROCESSOR_COUNT: 132}
L4 = {"name": "NVIDIA L4", _driver.COMPUTE_CAPABILITY_MAJOR: 8, _driver.COMPUTE_CAPABILITY_MINOR: 9,
      _driver.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 101376, _driver.MULTIPROCESSOR_COUNT: 58}


@pytest.fixture
def gpus(monkeypatch):
    """Device 0 an H100, device 1 an L4, a CUDA 12.9 driver; every driver question counted."""
    asked = []
    table = {0: H100, 1: L4}

    def attribute(device, which):
        asked.append((device, which))
        return table[device][which]

    monkeypatch.setattr(_driver, "attribute", attribute)
    monkeypatch.setattr(_driver, "name", lambda device: table[device]["name"])
    monkeypatch.setattr(_driver, "version", lambda: 12090)
    monkeypatch.delenv("CUFLASH_PORTABLE", raising=False)
    _device._read.cache_clear()
    yield asked
    _device._read.cache_clear()


def test_the_facts_are_read_once_per_device(gpus):
    h100 = _device.facts(0)
    assert h100[:5] == ("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132, 12090) and h100.arch == "sm_90"
    asked = len(gpus)
    for _ in range(3):
        facts = _kernels.device_facts(0)
        assert (facts.shared_limit, facts.multiprocessors, facts.sm90a) == (232448, 132, True)
    assert len(gpus) == asked
    assert _device.facts(1).arch == "sm_89" and len(gpus) == 2 * asked


def test_what_follows_for_the_kernels(gpus, monkeypatch):
    h100, l4 = _device.facts(0), _device.facts(1)
    assert (h100.sm90a, h100.clusters, h100.dependent_launches) == (True, True, True)
    assert (l4.sm90a, l4.clusters, l4.dependent_launches) == (False, False, False)
    monkeypatch.setattr(_driver, "version", lambda: 12020)
    _device._read.cache_clear()
    assert not _device.facts(0).dependent_launches  # (no graph capture of them before 12.3)
    monkeypatch.setenv("CUFLASH_PORTABLE", "1")  # read at each call: plans made afresh follow it
    assert _device.facts(0)[5:8] == (False, False, False)
    assert not _kernels.device_facts(0).sm90a
    monkeypatch.setenv("CUFLASH_PORTABLE", "0")
    assert _kernels.device_facts(0)[5:7] == (True, True)


def test_the_resident_ctas_are_read_once_where_a_plan_asks(gpus, monkeypatch):
    """The planner's one fact of a compiled kernel: read from the loaded kernel once, and
    only for the plans that ask (no GPU: the compiler and the driver's load stand in)."""
    compiled = _compile.Compiled(b"cubin", "kernel", _compile.Resources(64, 0, 0, 0))
    loads, asked = [], []
    monkeypatch.setattr(_compile, "compile_kernel", lambda *args, **kwargs: compiled)
    monkeypatch.setattr(_driver, "load_function", lambda *args: loads.append(args) or 1000 + len(loads))
    monkeypatch.setattr(_driver, "resident_blocks", lambda *args: asked.append(args) or 3)
    _compile.load_kernel.cache_clear()
    _compile.resident_ctas.cache_clear()
    try:
        kernel = _plan.kernel("forward", "bfloat16", 128, True, True, False, 232448)
        assert _compile.load_kernel(kernel, 0) == 1001 and len(loads) == 1 and not asked
        resident_ctas = _kernels.device_facts(0).resident_ctas
        assert resident_ctas(kernel) == 3 and resident_ctas(kernel) == 3
        assert len(loads) == len(asked) == 1 and asked == [(1001, kernel.threads, kernel.shared_bytes)]
        assert _plan.tile_group(kernel, 200, _kernels.device_facts(0)) == 67  # (132 x 3 / 4 = 99 a group at most)
    finally:
        _compile.load_kernel.cache_clear()
        _compile.resident_ctas.cache_clear()
