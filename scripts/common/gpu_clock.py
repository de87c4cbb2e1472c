"""The SM clock against the GPU's global timer, for timelines whose trace points stamp
clock64() (scripts/sm90/sm90_timeline.py, scripts/decode/decode_timeline.py): imported
from the repository root (PYTHONPATH=.), not run."""
import contextlib

import cupy

CALIBRATE = r"""
extern "C" __global__ void calibrate(unsigned long long* out) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while (t1 - t0 < 2000000);
  out[0] = clock64() - c0;
  out[1] = t1 - t0;
}
"""


def cycles_per_ns() -> float:
    """clock64() ticks per %globaltimer ns over 2 ms of one thread's spinning (the second
    launch: the first pays for loading the kernel)."""
    out = cupy.zeros(2, dtype=cupy.uint64)
    kernel = cupy.RawKernel(CALIBRATE, "calibrate")
    kernel((1,), (1,), (out,))
    kernel((1,), (1,), (out,))
    cycles, ns = out.get()
    return float(cycles) / float(ns)


@contextlib.contextmanager
def stamping(source: str, patched, words: int):
    """(trace, rate) for the calls inside: a zeroed int64 trace of ``words`` on the GPU, into
    which the kernels of ``source`` (a file under cuflash/cuda, rewritten by
    patched(text, trace address)) stamp, and the SM clock's ticks per ns (printed)."""
    import torch

    from cuflash import experiment
    trace = torch.zeros(words, dtype=torch.int64, device="cuda")
    rate = cycles_per_ns()
    print(f"SM clock at rest {rate:.3f} GHz (clock64 per globaltimer ns)")
    with experiment.override(patches={source: lambda text: patched(text, trace.data_ptr())}):
        yield trace, rate
