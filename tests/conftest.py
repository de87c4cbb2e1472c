import functools
import os

# JAX must not take most of the GPU's memory up front: CuPy and torch share it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# pytest -n: one BLAS thread per worker; workers times cores spinning threads slow the float64 oracle many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import pytest

# CUFLASH_REQUIRE_GPU: "1" fails the gpu and hopper tests where no GPU answers, "hopper" also
# fails the hopper tests on a GPU that is not compute capability 9.0; unset or "0" skips them.
REQUIRE_GPU = ("", "0", "1", "hopper")
HOPPER_REASON = "needs a compute capability 9.0 GPU (H100, H200)"

# The Hopper tests: checked here (not a skipif at import) so CUFLASH_REQUIRE_GPU=hopper can fail them.
hopper = pytest.mark.hopper


@functools.cache
def _probe() -> tuple[str | None, str]:
    """(None, device 0's compute capability) where a GPU answers, else (why not, "")."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        capability = str(cupy.cuda.Device(0).compute_capability) if count else ""
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "cupy":
            return "CuPy is not installed", ""
        # A CuPy that fails to import or a driver that does not answer is a broken setup, not a missing GPU.
        return f"no usable GPU: {type(error).__name__}: {error}", ""
    return ("no GPU (0 devices)", "") if count == 0 else (None, capability)


def gpu_available() -> bool:
    return _probe()[0] is None


def _missing(item) -> tuple[str | None, bool]:
    """(why the item cannot run here, whether CUFLASH_REQUIRE_GPU makes that a failure);
    (None, False) for an item that can run, the CPU tests among them."""
    # Markers, not keywords: a parameter's id or a test's name may read "gpu" or "hopper" too.
    wants_hopper, wants_gpu = (item.get_closest_marker(name) is not None for name in ("hopper", "gpu"))
    if not (wants_hopper or wants_gpu):
        return None, False
    require = os.environ.get("CUFLASH_REQUIRE_GPU", "")
    why, capability = _probe()
    if why is not None:
        return why, require in ("1", "hopper")
    if wants_hopper and capability != "90":
        why = f"{HOPPER_REASON}; device 0 is compute capability {capability[:-1]}.{capability[-1]}"
        return why, require == "hopper"
    return None, False


def pytest_configure(config):
    config.addinivalue_line("markers", f"hopper: {HOPPER_REASON}; skipped elsewhere")
    require = os.environ.get("CUFLASH_REQUIRE_GPU", "")
    if require not in REQUIRE_GPU:  # a misspelt value must not quietly skip what it was set to require
        raise pytest.UsageError(f"CUFLASH_REQUIRE_GPU must be one of {REQUIRE_GPU[1:]} or unset, not {require!r}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        why, required = _missing(item)
        if why is not None and not required:
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_runtest_setup(item):
    why, required = _missing(item)
    if required:
        require = os.environ["CUFLASH_REQUIRE_GPU"]
        pytest.fail(f"CUFLASH_REQUIRE_GPU={require} and this test cannot run: {why}", pytrace=False)


@pytest.fixture(params=["as planned", "portable"])
def forward_family(request, monkeypatch):
    """The test once as the planner has it (on a Hopper GPU the sm_90a forward from head
    dim 64) and once with CUFLASH_PORTABLE=1 (the mma.sync kernels other GPUs run); the
    second skipped where it would repeat the first. Plans are forgotten on both sides."""
    from cuflash import _device, experiment
    if request.param == "portable":
        if _device.portable() or _device.facts(0).capability != (9, 0):
            pytest.skip("the mma.sync kernels are this run's only forward: 'as planned' ran them")
        monkeypatch.setenv("CUFLASH_PORTABLE", "1")
    with experiment.override():
        yield request.param
