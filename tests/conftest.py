import functools
import os

# JAX must not take most of the GPU's memory up front: CuPy and torch share it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; CuPy sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
