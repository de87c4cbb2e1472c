"""The GPU probe of tests/conftest.py: gpu and hopper tests skip with the probe's reason where
no GPU answers, and CUFLASH_REQUIRE_GPU turns that skip into an error, CPU tests untouched.
Each case runs a small suite in a subprocess, under this conftest and a stand-in CuPy."""
from pathlib import Path

import pytest

from .conftest import gpu_available

pytest_plugins = ["pytester"]

SUITE = """
import pytest

@pytest.mark.gpu
def test_on_a_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.hopper
def test_on_hopper():
    pass

def test_on_the_cpu():
    pass
"""

# Stand-ins for CuPy, one for each answer the probe tells apart.
BROKEN = """
class CUDARuntimeError(RuntimeError):
    pass

class _Runtime:
    @staticmethod
    def getDeviceCount():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

class cuda:
    runtime = _Runtime
"""
NOT_INSTALLED = 'raise ModuleNotFoundError("No module named \'cupy\'", name="cupy")'
FAILS_TO_IMPORT = 'raise ImportError("libcuda.so.1: cannot open shared object file")'


def device(count: int, capability: str = "") -> str:
    return f"""
class _Device:
    def __init__(self, index):
        self.compute_capability = {capability!r}

class _Runtime:
    @staticmethod
    def getDeviceCount():
        return {count}

class cuda:
    runtime = _Runtime
    Device = _Device
"""


def run(pytester, monkeypatch, cupy: str | None, require: str | None):
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers = gpu: needs a CUDA GPU\n")
    pytester.makepyfile(test_suite=SUITE)
    if cupy is not None:  # the test folder leads the subprocess's path, ahead of any real CuPy
        pytester.mkpydir("cupy").joinpath("__init__.py").write_text(cupy)
    if require is None:
        monkeypatch.delenv("CUFLASH_REQUIRE_GPU", raising=False)
    else:
        monkeypatch.setenv("CUFLASH_REQUIRE_GPU", require)
    # Hypothesis's plugin is most of a run's start-up, and these suites draw nothing.
    return pytester.runpytest_subprocess("-rsE", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")


NO_GPU = {"broken": (BROKEN, "no usable GPU: CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected"),
          "no devices": (device(0), "no GPU (0 devices)"),
          "not installed": (NOT_INSTALLED, "CuPy is not installed"),
          "fails to import": (FAILS_TO_IMPORT,
                              "no usable GPU: ImportError: libcuda.so.1: cannot open shared object file")}


@pytest.mark.parametrize("cupy,reason", NO_GPU.values(), ids=NO_GPU.keys())
def test_without_a_gpu_the_gpu_tests_skip_with_the_probes_reason(pytester, monkeypatch, cupy, reason):
    result = run(pytester, monkeypatch, cupy, None)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines([f"SKIPPED *test_suite.py*: {reason}"])


REQUIRED = {**{f"{name}, 1": (*case, "1") for name, case in NO_GPU.items()},
            "broken, hopper": (*NO_GPU["broken"], "hopper")}


@pytest.mark.parametrize("cupy,reason,require", REQUIRED.values(), ids=REQUIRED.keys())
def test_required_without_a_gpu_the_gpu_tests_error_with_the_probes_reason(pytester, monkeypatch, cupy, reason,
                                                                           require):
    result = run(pytester, monkeypatch, cupy, require)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines([f"CUFLASH_REQUIRE_GPU={require} and this test cannot run: {reason}",
                                 "ERROR test_suite.py::test_on_a_gpu - Failed: CUFLASH_REQUIRE_GPU*"])


@pytest.mark.skipif(gpu_available(), reason="a CUDA GPU is here")
def test_required_on_this_machine_without_a_gpu_the_gpu_tests_error(pytester, monkeypatch):
    result = run(pytester, monkeypatch, None, "1")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["CUFLASH_REQUIRE_GPU=1 and this test cannot run: no *",
                                 "ERROR test_suite.py::test_on_a_gpu - Failed: CUFLASH_REQUIRE_GPU*"])


@pytest.mark.parametrize("require", [None, "0", "1"])
def test_a_gpu_other_than_hopper_skips_the_hopper_tests(pytester, monkeypatch, require):
    result = run(pytester, monkeypatch, device(1, "80"), require)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED *test_suite.py*: needs a compute capability 9.0 GPU (H100, H200); "
                                 "device 0 is compute capability 8.0"])


def test_a_gpu_other_than_hopper_fails_the_hopper_tests_where_hopper_is_required(pytester, monkeypatch):
    result = run(pytester, monkeypatch, device(1, "80"), "hopper")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["CUFLASH_REQUIRE_GPU=hopper and this test cannot run: needs a compute capability 9.0 "
                                 "GPU (H100, H200); device 0 is compute capability 8.0",
                                 "ERROR test_suite.py::test_on_hopper - Failed: CUFLASH_REQUIRE_GPU*"])


@pytest.mark.parametrize("require", [None, "1", "hopper"])
def test_a_hopper_gpu_runs_every_test(pytester, monkeypatch, require):
    result = run(pytester, monkeypatch, device(1, "90"), require)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=3)


def test_a_misspelt_requirement_is_a_usage_error(pytester, monkeypatch):
    result = run(pytester, monkeypatch, device(0), "yes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*CUFLASH_REQUIRE_GPU must be one of ('0', '1', 'hopper') or unset, not 'yes'*"])
