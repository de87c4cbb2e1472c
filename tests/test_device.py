"""The device's facts (cuflash/_device.py): read from the driver once per device, and what
follows from them for the kernels, on stand-in GPUs (no GPU needed)."""
import pytest

from cuflash import _device, _driver, _kernels

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
    _device.facts.cache_clear()
    yield asked
    _device.facts.cache_clear()


def test_the_facts_are_read_once_per_device(gpus):
    h100 = _device.facts(0)
    assert h100 == _device.Device("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132, 12090) and h100.arch == "sm_90"
    asked = len(gpus)
    for _ in range(3):
        assert (_kernels.shared_limit(0), _kernels.multiprocessors(0), _kernels.sm90a(0)) == (232448, 132, True)
    assert len(gpus) == asked
    assert _device.facts(1).arch == "sm_89" and len(gpus) == 2 * asked


def test_what_follows_for_the_kernels(gpus, monkeypatch):
    h100, l4 = _device.facts(0), _device.facts(1)
    assert (h100.sm90a, h100.clusters, h100.dependent_launches) == (True, True, True)
    assert (l4.sm90a, l4.clusters, l4.dependent_launches) == (False, False, False)
    assert not h100._replace(driver=12020).dependent_launches  # (no graph capture of them before 12.3)
    monkeypatch.setenv("CUFLASH_PORTABLE", "1")  # read at each question: plans made afresh follow it
    assert (h100.sm90a, h100.clusters, h100.dependent_launches) == (False, False, False)
    assert not _kernels.sm90a(0)
    monkeypatch.setenv("CUFLASH_PORTABLE", "0")
    assert _kernels.sm90a(0) and _kernels.clusters(0) and _kernels.dependent_launches(0)
