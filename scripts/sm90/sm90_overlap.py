"""Whether each sm_90a forward variant's softmax runs while its P V product is in flight.

    python scripts/sm90/sm90_overlap.py            # every variant; exit status 1 if one lost it

This script compiles every variant (cuflash's kernel cache), disassembles it (nvdisasm: on
PATH or from the nvidia-cuda-nvdisasm wheel, in the test extra) and counts the MUFU.EX2
between the main loop's two waits (cuflash/_sass.py says why they matter); test_sm90.py
does the same for the variants it compiles. No GPU is needed.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cuflash import _compile, _plan  # noqa: E402
from cuflash._sass import (disassemble, exponentials_between_waits, find_nvdisasm,  # noqa: E402
                           keeps_softmax_beside_values, overlapped)


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
