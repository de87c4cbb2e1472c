"""The SM clock against the GPU's global timer, for timelines whose trace points stamp
clock64() (scripts/sm90/sm90_timeline.py, scripts/decode/decode_timeline.py): imported
from the repository root (PYTHONPATH=.), not run."""
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
