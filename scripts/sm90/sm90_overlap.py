"""Whether each sm_90a forward variant's softmax runs while its P V product is in flight.

    python scripts/sm90_overlap.py            # every variant; exit status 1 if one lost it

A consumer's turn issues S_j and P_{j-1} V_{j-1}, waits for S_j (WARPGROUP.DEPBAR.LE
gsb0, 0x1), turns S_j into P_j and only then waits for P V (gsb0, 0x0). ptxas moves that
second wait up to the top of its block unless something keeps it down (fwd.cu,
sm90::keep_before_wait), and the exponentials then wait for P V to land: a loss of 2-6%
at d 128 that no output shows. This script compiles every variant (cuflash's kernel
cache), disassembles it (nvdisasm: on PATH or from the nvidia-cuda-nvdisasm wheel, in the
test extra) and counts the MUFU.EX2 between the main loop's two waits; test_sm90.py does
the same for the variants it compiles. No GPU is needed.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuflash import _compile, _plan  # noqa: E402


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(p) for base in map(Path, nvidia.__path__) for p in base.glob("*/bin/nvdisasm")), None)


def disassemble(cubin: bytes, nvdisasm: str) -> str:
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


def keeps_softmax_beside_values(kernel: _plan.Sm90Forward) -> bool:
    """fwd.cu's kOverlapSoftmax: every variant but d 256 under a mask (it spills there)."""
    return kernel.head_dim < 256 or not kernel.local


def overlapped(sass: str, kernel: _plan.Sm90Forward) -> bool:
    """Each thread exponentiates block_n / 2 scores a key tile (two rows, a quarter of the
    keys each): all of them ahead of P V's wait."""
    return exponentials_between_waits(sass) >= kernel.block_n // 2


def main() -> int:
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        sys.exit("nvdisasm: not on PATH, and no nvidia-cuda-nvdisasm wheel")
    lost = 0
    for kernel in _plan.all_kernels("sm_90a"):
        if not isinstance(kernel, _plan.Sm90Forward):
            continue
        sass = disassemble(_compile.compile_kernel(kernel.source, kernel.instance, "sm_90a").cubin, nvdisasm)
        expected, ahead = keeps_softmax_beside_values(kernel), overlapped(sass, kernel)
        lost += expected and not ahead
        status = "ok" if ahead else "LOST" if expected else "-"
        print(f"{status:4} {exponentials_between_waits(sass):4d} exp2 before P V's wait  {kernel.instance}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
