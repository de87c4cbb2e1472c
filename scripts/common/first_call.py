"""A cached first call in a new process: import cuflash, load the kernel from the disk
cache, launch. Run it twice (the first run fills the cache); the CUDA context and the
input are made before the clock starts, as an application would have them. Where Python
writes no bytecode (PYTHONDONTWRITEBYTECODE, a fresh copy of the tree) every import
compiles cuflash's sources; compile them first, as a pip install does:

    python -m compileall -q cuflash
    PYTHONPATH=. python scripts/common/first_call.py [cupy|torch]
"""
import sys
import time

framework = sys.argv[1] if len(sys.argv) > 1 else "cupy"
if framework == "torch":
    import torch
    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.float16)
    sync = torch.cuda.synchronize
else:
    import cupy
    q = cupy.random.rand(1, 128, 1, 64).astype(cupy.float16)
    sync = cupy.cuda.Device().synchronize
sync()
start = time.perf_counter()
import cuflash  # noqa: E402
imported = time.perf_counter()
cuflash.attention(q, q, q, causal=True)
sync()
first = time.perf_counter()
cuflash.attention(q, q, q, causal=True)
sync()
second = time.perf_counter()
heavy = [m for m in ("cupy", "torch", "jax") if m in sys.modules and m != framework]
warm = []
for _ in range(5):  # warm calls, back to back, in this process (CuPy loaded only if the caller's)
    tick = time.perf_counter()
    for _ in range(1000):
        cuflash.attention(q, q, q, causal=True)
    warm.append((time.perf_counter() - tick) * 1e3)
    sync()
print(f"{framework}: import cuflash {(imported - start) * 1e3:.1f} ms, first call {(first - imported) * 1e3:.1f} ms, "
      f"together {(first - start) * 1e3:.1f} ms; second call {(second - first) * 1e3:.2f} ms; "
      f"warm call {sorted(warm)[2]:.1f} us; also imported: {heavy or 'nothing heavy'}")
