"""Fill the kernel cache off the GPU for the benchmark's shapes, so that a timed run on
the GPU machine spends no device minutes in NVRTC. The cache key includes the NVRTC
version: compile with the GPU machine's (the H200's CuPy uses NVRTC 13.0: a venv
with nvidia-cuda-nvrtc==13.0.*) and carry the cache there (CUFLASH_CACHE_DIR).

    CUFLASH_CACHE_DIR=.baseline/cache python scripts/common/precompile.py cuflash .baseline/cuflash_x
"""
import argparse
import concurrent.futures
import functools
import importlib
import itertools

from cuflash import bench

SHARED_LIMIT_SM90 = 227 * 1024


@functools.cache
def _module(path: str, name: str):
    return importlib.import_module(f"{bench._load_baseline(path).__name__}.{name}")


def _compile(path: str, source: str, instance: str, arch: str) -> str:
    r = _module(path, "_compile").compile_kernel(source, instance, arch).resources
    return f"{r.registers:4d} regs {r.spill_stores:4d} B spilled  {path}: {instance}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    jobs = []
    for path in args.packages:
        plan = _module(path, "_plan")
        for d, local in itertools.product(map(int, args.head_dims.split(",")), (False, True)):
            one_pass = plan.has_tile("backward", d, False, SHARED_LIMIT_SM90)
            for kind in ("forward", "backward") if one_pass else ("forward", "backward_dkdv", "backward_dq"):
                kernel = plan.kernel(kind, args.dtype, d, local, True, False, SHARED_LIMIT_SM90)
                jobs.append((path, kernel.source, kernel.instance))
        jobs += [(path, plan.ELEMENTWISE[kind][0], plan.Elementwise(kind, args.dtype).instance)
                 for kind in plan.ELEMENTWISE]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(_compile, *zip(*jobs), itertools.repeat(args.arch)):
            print(line, flush=True)


if __name__ == "__main__":
    main()
