"""Compare the machine code of every kernel variant between two copies of cuflash/cuda.

    python scripts/common/sass_diff.py                        # the working tree against HEAD, every variant
    python scripts/common/sass_diff.py --sample               # the covering sample only (44 pairs)
    python scripts/common/sass_diff.py --base /tmp/cuda-base  # against a folder holding another copy
    python scripts/common/sass_diff.py --base v0.3 --only attention_forward --arch sm_90
    python scripts/common/sass_diff.py --sample --ptx /tmp/ptx  # and the PTX of each variant that differs

For a change meant to leave the kernels as they are (renaming, moving code between
files, naming a step): every (arch, variant) of cuflash._plan is compiled by NVRTC
from each copy of the sources and the kernel's ELF sections are compared byte for
byte: its code (.text), the constant bank its code reads (.nv.constant2), its
attributes (.nv.info: parameters, barriers, the offsets of its exits; the one symbol
index there is left out) and its shared memory, and ptxas's registers and spills.
Other sections that differ (global constants the code does not read, the frame table)
are counted, and named with --verbose, but do not count as a difference; the symbol
tables are not compared (file-local names carry a hash of the source file). Exit status
1 when any variant's code differs. No GPU is needed. The whole sweep (968 pairs) takes
20-40 minutes on 2 cores; the covering sample reaches every template branch in a few.

A variant is looked up by its template name in each copy: the file that defines the
__global__ template, so a kernel may move to another file between the two copies.
Compiled cubins go through cuflash's disk cache (a folder of this script's own unless
--cache says otherwise; its key covers every source byte), so a copy already compiled
is not compiled again.

Where the code differs, the PTX usually says why sooner than the SASS: --ptx DIR writes
both copies' PTX of each such variant, virtual registers and labels renumbered, for a
plain diff. (Found that way: the same arithmetic written through one more inline
function, or an argument passed inside a struct, can reorder LLVM's instructions; ptxas
then schedules differently.)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cuflash import _compile, _plan, experiment  # noqa: E402

# Sections of one kernel, named after its mangled name: the code and what the code reads.
KERNEL_SECTIONS = (".text.", ".nv.constant2.", ".nv.info.", ".nv.shared.", ".rel.text.", ".rela.text.")
# Symbol names: those of file-local constants carry a hash of the source file, so they
# differ whenever a source does.
NAMES_ONLY = (".shstrtab", ".strtab", ".symtab")


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of an ELF64 file (a cubin)."""
    (sh_offset,) = struct.unpack_from("<Q", elf, 0x28)
    sh_size, sh_count, sh_names = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i: int) -> tuple[int, int, int, int]:  # name offset, type, file offset, size
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", elf, sh_offset + i * sh_size)
        return name, kind, offset, size

    names_offset = header(sh_names)[2]
    sections = {}
    for i in range(1, sh_count):
        name, kind, offset, size = header(i)
        start = names_offset + name
        label = elf[start:elf.index(b"\0", start)].decode()
        sections[label] = b"" if kind == 8 else elf[offset:offset + size]  # SHT_NOBITS: no bytes in the file
    return sections


EIATTR_PARAM_CBANK = 0x0A


def without_symbol_indices(info: bytes, every_record: bool) -> bytes:
    """An .nv.info section with its symbol indices zeroed (they move whenever the symbol
    table gains an entry, a new constant anywhere): in a kernel's own, the index of its
    parameter bank; in the file's (every_record), the one each record starts with (the
    kernel's registers, stack, ... each under its symbol)."""
    out, i = bytearray(info), 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != 0x04:  # EIFMT_NVAL / BVAL / HVAL: 4 bytes in all
            i += 4
            continue
        (size,) = struct.unpack_from("<H", info, i + 2)  # EIFMT_SVAL: a payload of `size` bytes
        if (every_record or attr == EIATTR_PARAM_CBANK) and size >= 4:
            out[i + 4:i + 8] = bytes(4)
        i += 4 + size
    return bytes(out)


def kernel_parts(elf: bytes, lowered_name: str) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The kernel's own sections (the mangled name written <kernel>, so that a renamed
    instance still compares) and the rest."""
    own, rest = {}, {}
    for name, data in elf_sections(elf).items():
        if name in NAMES_ONLY:
            continue
        label = name.replace(lowered_name, "<kernel>")
        if name.startswith(".nv.info"):
            data = without_symbol_indices(data, every_record=name == ".nv.info")
        (own if name.startswith(KERNEL_SECTIONS) else rest)[label] = data
    return own, rest


def template_name(instance: str) -> str:
    return re.match(r"cuflash::(\w+)<", instance)[1]


def defining_source(cuda_dir: Path, preferred: str, instance: str) -> str:
    """The .cu file of cuda_dir that defines the __global__ template of ``instance``:
    ``preferred`` (the plan's) when it does, else the first that does."""
    pattern = re.compile(rf"__global__[^;{{]*?\b{template_name(instance)}\s*\(")
    candidates = [cuda_dir / preferred] + sorted(p for p in cuda_dir.rglob("*.cu") if p != cuda_dir / preferred)
    for path in candidates:
        if path.is_file() and pattern.search(path.read_text()):
            return path.relative_to(cuda_dir).as_posix()  # (a family's folder included: sm90/fwd.cu)
    raise SystemExit(f"no .cu file of {cuda_dir} defines {template_name(instance)}")


def _compile_in(cuda_dir: str, source: str, instance: str, arch: str):
    """(own sections, other sections, resources) of one instance compiled from cuda_dir
    (in a worker process)."""
    with experiment.override(sources=cuda_dir):
        compiled = _compile.compile_kernel(source, instance, arch)
    own, rest = kernel_parts(compiled.cubin, compiled.lowered_name)
    return own, rest, compiled.resources


def _sources_at(revision: str) -> Path:
    """cuflash/cuda as of a git revision, in a new temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="cuflash-cuda-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "cuflash/cuda"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder), "--strip-components=2"], input=archive, check=True)
    return folder


def describe(base: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    """What differs between two name -> bytes maps, one phrase per section."""
    out = []
    for name in sorted(base.keys() | new.keys()):
        a, b = base.get(name), new.get(name)
        if a == b:
            continue
        if a is None or b is None:
            out.append(f"{name} only in the {'new' if a is None else 'base'} copy")
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        where = f", first difference at byte {first:#x}"
        if name.startswith(".text"):
            where += f" (instruction {first // 16})"  # 16 bytes an instruction since sm_70
        out.append(f"{name}: {len(a)} -> {len(b)} bytes{where}")
    return out


def normalized_ptx(cuda_dir: Path, source: str, instance: str, arch: str) -> str:
    """The PTX of one instance, with virtual registers and labels renumbered in order of
    appearance so that two copies differ only where their instructions do."""
    with experiment.override(sources=cuda_dir):
        nvrtc, sources = _compile._nvrtc(), _compile._sources()
    headers = {n: t for n, t in sources.items() if n.endswith(".cuh")}
    prog = nvrtc.createProgram(sources[source].decode(), source, list(headers.values()), [n.encode() for n in headers])
    try:
        nvrtc.addNameExpression(prog, instance)
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *_compile.OPTIONS])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    lines = [line for line in ptx.rstrip("\0").splitlines() if not line.startswith((".global", "\t.reg"))]
    names: dict[str, str] = {}
    counts: dict[str, int] = {}

    def renumber(match: re.Match) -> str:
        if match[0] not in names:
            counts[match[1]] = counts.get(match[1], -1) + 1
            names[match[0]] = f"{match[1]}{counts[match[1]]}"
        return names[match[0]]

    return "\n".join(re.sub(r"(%rd|%rs|%r|%fd|%f|%p|\$L__BB)[0-9_]+", renumber, line) for line in lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD",
                        help="a folder holding a copy of cuflash/cuda, or a git revision (default HEAD)")
    parser.add_argument("--new", default=str(ROOT / "cuflash" / "cuda"),
                        help="the copy under test (default: the working tree's cuflash/cuda)")
    parser.add_argument("--arch", default="sm_80,sm_90", help="comma-separated (default sm_80,sm_90)")
    parser.add_argument("--sample", action="store_true",
                        help="only _plan.covering_sample's variants, which reach every template branch")
    parser.add_argument("--only", action="append", default=[],
                        help="only variants whose instance contains this text (repeatable: any of them)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "cuflash-sass-diff"),
                        help="the kernel cache folder for both copies")
    parser.add_argument("--ptx", metavar="DIR", help="write both copies' PTX of each variant whose code differs")
    parser.add_argument("--verbose", action="store_true", help="also name the other sections that differ")
    args = parser.parse_args()

    base = Path(args.base).resolve() if Path(args.base).is_dir() else _sources_at(args.base)
    new = Path(args.new).resolve()
    os.environ["CUFLASH_CACHE_DIR"] = args.cache  # read by the workers' cuflash._compile
    archs = tuple(args.arch.split(","))
    pairs = (_plan.covering_sample(archs) if args.sample
             else [(arch, k) for arch in archs for k in _plan.all_kernels(arch)])
    pairs = [(arch, k) for arch, k in pairs if not args.only or any(text in k.instance for text in args.only)]
    print(f"base {base}\nnew  {new}\n{len(pairs)} (arch, variant) pairs, {args.jobs} processes", flush=True)

    start, results = time.perf_counter(), {}
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = {}
        for index, (arch, k) in enumerate(pairs):
            for side, folder in (("base", base), ("new", new)):
                source = defining_source(folder, k.source, k.instance)
                futures[pool.submit(_compile_in, str(folder), source, k.instance, arch)] = (index, side)
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[future]] = future.result()
            if done % 20 == 0 or done == len(futures):
                print(f"  {done}/{len(futures)} compiled, {time.perf_counter() - start:.0f} s", flush=True)

    code_differs = data_differs = 0
    for index, (arch, k) in enumerate(pairs):
        (own_a, rest_a, res_a), (own_b, rest_b, res_b) = results[index, "base"], results[index, "new"]
        code = describe(own_a, own_b)
        if res_a != res_b:
            code.append(f"resources {res_a} -> {res_b}")
        if res_b.spill_stores or res_b.spill_loads:
            code.append(f"spills {res_b.spill_stores} bytes")
        if code:
            code_differs += 1
            print(f"DIFFERS {arch} {k.instance}\n    " + "\n    ".join(code))
            if args.ptx:
                folder = Path(args.ptx)
                folder.mkdir(parents=True, exist_ok=True)
                stem = re.sub(r"\W+", "_", f"{arch}_{k.instance.removeprefix('cuflash::')}").strip("_")
                for side, copy in (("base", base), ("new", new)):
                    text = normalized_ptx(copy, defining_source(copy, k.source, k.instance), k.instance, arch)
                    (folder / f"{stem}.{side}.ptx").write_text(text)
                print(f"    diff {folder / stem}.base.ptx {folder / stem}.new.ptx")
        elif rest_a != rest_b:
            data_differs += 1
            if args.verbose:
                print(f"same code, other ELF data differs: {arch} {k.instance}: "
                      + "; ".join(describe(rest_a, rest_b)))
    print(f"{len(pairs)} (arch, variant) pairs compared: {code_differs} differ in code "
          f"(.text, constant bank, attributes, shared memory, registers, spills); "
          f"{data_differs} differ only outside the kernel's sections")
    return 1 if code_differs else 0


if __name__ == "__main__":
    sys.exit(main())
