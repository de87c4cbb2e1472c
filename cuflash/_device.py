"""What cuflash needs to know of a GPU, read from the driver once per device (``facts``):
its name, compute capability, opt-in shared memory per block and multiprocessors, and the
driver's version; and what follows for the kernels: the arch to compile for, the sm_90a
kernels, thread block clusters and programmatic dependent launch, the last three off
where the environment's CUFLASH_PORTABLE is set (to anything but 0: every call on the
kernels other GPUs run, for comparisons and bug reports; read at each question, so that
plans made afresh follow it)."""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

from . import _driver


class Device(NamedTuple):
    name: str
    capability: tuple[int, int]
    shared_limit: int  # opt-in dynamic shared memory per block, bytes
    multiprocessors: int
    driver: int  # the driver's CUDA version, 1000 * major + 10 * minor

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def sm90a(self) -> bool:
        """The sm_90a kernels (TMA, wgmma): compute capability 9.0 (H100, H200)."""
        return self.capability == (9, 0) and not portable()

    @property
    def clusters(self) -> bool:
        """The KV-cache call's splits merge in thread block clusters (from 9.0)."""
        return self.capability >= (9, 0) and not portable()

    @property
    def dependent_launches(self) -> bool:
        """A plan's kernel may start while the one before it ends, waiting in the kernel for
        its results (from 9.0, with a driver that also captures such launches into CUDA
        graphs: CUDA 12.3)."""
        return self.capability >= (9, 0) and self.driver >= 12030 and not portable()


@functools.cache
def facts(device: int) -> Device:
    def attribute(which: int) -> int:
        return _driver.attribute(device, which)

    return Device(_driver.name(device),
                  (attribute(_driver.COMPUTE_CAPABILITY_MAJOR), attribute(_driver.COMPUTE_CAPABILITY_MINOR)),
                  attribute(_driver.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), attribute(_driver.MULTIPROCESSOR_COUNT),
                  _driver.version())


def portable() -> bool:
    return os.environ.get("CUFLASH_PORTABLE", "0") not in ("", "0")
