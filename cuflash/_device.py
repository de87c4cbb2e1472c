"""What cuflash needs to know of a GPU, as one value (``facts``), the planner's view of the
device it plans for: its name, compute capability, opt-in shared memory per block and
multiprocessors, and the driver's version, read from the driver once per device; what
follows for the kernels (the arch to compile for, the sm_90a kernels, thread block
clusters and programmatic dependent launch), the last three off where the environment's
CUFLASH_PORTABLE is set (to anything but 0: every call on the kernels other GPUs run, for
comparisons and bug reports; read at each call of ``facts``, so that plans made afresh
follow it); and the CTAs of a compiled kernel one multiprocessor holds at once, which
the compile layer reads as it loads the kernel (``_kernels.device_facts`` gives plans
the facts with it)."""
from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

from . import _driver


def _one(kernel) -> int:
    return 1


class Device(NamedTuple):
    """A GPU as the planner takes it: what the driver tells, and what follows for the kernels."""
    name: str
    capability: tuple[int, int]
    shared_limit: int  # opt-in dynamic shared memory per block, bytes
    multiprocessors: int
    driver: int  # the driver's CUDA version, 1000 * major + 10 * minor
    # The sm_90a kernels (TMA, wgmma): compute capability 9.0 (H100, H200).
    sm90a: bool = False
    # The KV-cache call's splits merge in thread block clusters (from 9.0).
    clusters: bool = False
    # A plan's kernel may start while the one before it ends, waiting in the kernel for its
    # results (from 9.0, with a driver that also captures such launches into CUDA graphs: 12.3).
    dependent_launches: bool = False
    # kernel (a variant of cuflash._plan) -> its CTAs one multiprocessor holds at once (its
    # registers, shared memory and threads decide); 1 in plans made with no compiled kernel.
    resident_ctas: Callable[[object], int] = _one

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def facts(device: int) -> Device:
    """The facts of ``device``: read once, what follows for the kernels as of this call."""
    read = _read(device)
    if portable():
        return read
    from_hopper = read.capability >= (9, 0)
    return read._replace(sm90a=read.capability == (9, 0), clusters=from_hopper,
                         dependent_launches=from_hopper and read.driver >= 12030)


@functools.cache
def _read(device: int) -> Device:
    def attribute(which: int) -> int:
        return _driver.attribute(device, which)

    return Device(_driver.name(device),
                  (attribute(_driver.COMPUTE_CAPABILITY_MAJOR), attribute(_driver.COMPUTE_CAPABILITY_MINOR)),
                  attribute(_driver.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), attribute(_driver.MULTIPROCESSOR_COUNT),
                  _driver.version())


def portable() -> bool:
    return os.environ.get("CUFLASH_PORTABLE", "0") not in ("", "0")
