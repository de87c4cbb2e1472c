"""The Hopper forward's machine code read back: whether its softmax runs while its P V
product is in flight.

A consumer's turn issues S_j and P_{j-1} V_{j-1}, waits for S_j (WARPGROUP.DEPBAR.LE
gsb0, 0x1), turns S_j into P_j and only then waits for P V (gsb0, 0x0). ptxas moves that
second wait up to the top of its block unless something keeps it down (sm90/fwd.cu,
sm90::keep_before_wait), and the exponentials then wait for P V to land: a loss of 2-6%
at d 128 that no output shows. These checks count the MUFU.EX2 between the main loop's
two waits in nvdisasm's listing (nvdisasm: on PATH or from the nvidia-cuda-nvdisasm
wheel, in the test extra). Used by tests/test_sm90.py and scripts/sm90/sm90_overlap.py;
no GPU needed.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._plan import Sm90Forward


def find_nvdisasm() -> str | None:
    """nvdisasm on PATH, else the nvidia-cuda-nvdisasm wheel's, else None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(p) for base in map(Path, nvidia.__path__) for p in base.glob("*/bin/nvdisasm")), None)


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """nvdisasm's listing of a cubin's code sections."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def exponentials_between_waits(sass: str) -> int:
    """The MUFU.EX2 between the first gsb0 0x1 wait that follows a P V product (an HGMMA
    reading B transposed: V) and the next gsb0 0x0 wait: the main loop's softmax; -1
    where there is no such pair."""
    after_values = in_window = False
    count = 0
    for line in sass.splitlines():
        if "HGMMA" in line and "tnspB" in line:
            after_values = True
        elif after_values and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            in_window = True
        elif in_window and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            return count
        elif in_window and re.search(r"\bMUFU\.EX2\b", line):
            count += 1
    return -1


def keeps_softmax_beside_values(kernel: Sm90Forward) -> bool:
    """fwd.cu's kOverlapSoftmax: every variant but d 256 under a mask (it spills there)."""
    return kernel.head_dim < 256 or not kernel.local


def overlapped(sass: str, kernel: Sm90Forward) -> bool:
    """Each thread exponentiates block_n / 2 scores a key tile (two rows, a quarter of the
    keys each): all of them ahead of P V's wait."""
    return exponentials_between_waits(sass) >= kernel.block_n // 2
