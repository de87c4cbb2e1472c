"""docs/api.md against the code.

- Its error table (``| input | example | raises | message contains |``) is executed: each
  example, a Python expression over the names the doc lists above the table, must raise
  exactly the named exception type, with the given text in its message. Rows that use
  torch or JAX names are skipped where those are not installed; rows whose example starts
  with ``gpu:`` (``gpu2:``) run only where CuPy sees one (two) GPUs.
- Every public function of cuflash, cuflash.torch, cuflash.jax and
  cuflash.flash_attn_interface (those whose library is installed) has its signature, as
  inspect sees it less annotations, in a code block of docs/api.md, and every parameter
  appears as code in the prose or tables of the section that holds that block.
- Every subcommand and option of ``python -m cuflash``, and every environment variable
  the package reads, is named in docs/api.md.
"""
from __future__ import annotations

import builtins
import functools
import importlib
import importlib.util
import inspect
import math
import pathlib
import re

import numpy as np
import pytest

import cuflash

from .conftest import gpu_available

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "api.md"
HEADER = ["input", "example", "raises", "message contains"]

# Names of the examples that need torch / JAX (cuflash.torch and cuflash.jax included:
# their tokens are "torch" and "jax").
TORCH_NAMES = {"torch", "tq", "tk", "tv", "tqp", "tkp", "tvp", "tcu_q", "tcu_k", "flash_attn_func",
               "flash_attn_varlen_func"}
JAX_NAMES = {"jax", "jnp", "jq", "jk", "jv", "jqp", "jkp", "jvp", "jcu_q", "jcu_k"}
GPU_MARKS = {"gpu": 1, "gpu2": 2}


@functools.cache
def doc() -> str:
    return DOC_PATH.read_text(encoding="utf-8")


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


@functools.cache
def _has_jax() -> bool:
    if importlib.util.find_spec("jax") is None:
        return False
    try:
        importlib.import_module("jax.experimental.buffer_callback")
    except ImportError:
        return False
    return True


@functools.cache
def _gpu_count() -> int:
    if not gpu_available():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


# -- the error table --------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), line
    return [c.strip() for c in line[1:-1].split("|")]


def _code(cell: str, where: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"{where}: expected one code span, got {cell!r}"
    return m[1]


def error_rows() -> list[tuple[int, str, str, str, str]]:
    """(line number, input, example, exception name, message) of each row of the table."""
    lines = doc().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and _cells(line) == HEADER]
    assert len(starts) == 1, f"docs/api.md needs exactly one table headed | {' | '.join(HEADER)} |"
    rows = []
    for i in range(starts[0] + 2, len(lines)):
        line = lines[i].strip()
        if not line.startswith("|"):
            break
        where = f"docs/api.md:{i + 1}"
        cells = _cells(line)
        assert len(cells) == len(HEADER), f"{where}: {len(cells)} cells (a '|' inside an example?)"
        what, example, raises, message = cells
        rows.append((i + 1, what, _code(example, where), _code(raises, where), _code(message, where)))
    return rows


ROWS = error_rows()


def _requirements(example: str) -> tuple[str, int, set[str]]:
    """(expression, GPUs needed, libraries needed) of an example."""
    gpus = 0
    m = re.match(r"(gpu2?):\s*(.*)", example)
    if m:
        gpus, example = GPU_MARKS[m[1]], m[2]
    tokens = set(re.findall(r"[A-Za-z_]\w*", example))
    needs = {"torch"} if tokens & TORCH_NAMES else set()
    if tokens & JAX_NAMES:
        needs.add("jax")
    return example, gpus, needs


@functools.cache
def _numpy_names() -> dict:
    rng = np.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    ns = {"np": np, "math": math, "cuflash": cuflash}
    ns.update({name: getattr(cuflash, name) for name in cuflash.__all__})
    ns["q"], ns["k"], ns["v"] = randn(2, 8, 4, 16), randn(2, 8, 2, 16), randn(2, 8, 2, 16)
    ns["out"], ns["lse"] = cuflash.attention(ns["q"], ns["k"], ns["v"], return_lse=True)
    ns["dout"] = np.ones_like(ns["out"])
    ns["slopes"] = np.full(4, 0.5, np.float32)
    ns["qp"], ns["kp"], ns["vp"] = randn(12, 4, 16), randn(10, 2, 16), randn(10, 2, 16)
    ns["cu_q"], ns["cu_k"] = np.array([0, 5, 12], np.int32), np.array([0, 4, 10], np.int32)
    ns["outp"], ns["lsep"] = cuflash.attention_varlen(ns["qp"], ns["kp"], ns["vp"], ns["cu_q"], ns["cu_k"], 7, 6,
                                                      return_lse=True)
    ns["doutp"] = np.ones_like(ns["outp"])
    ns["kc"], ns["vc"] = randn(2, 20, 2, 16), randn(2, 20, 2, 16)
    ns["kn"], ns["vn"] = randn(2, 1, 2, 16), randn(2, 1, 2, 16)
    ns["lens"] = np.array([5, 3], np.int32)
    ns["pk"], ns["pv"] = randn(6, 8, 2, 16), randn(6, 8, 2, 16)
    ns["table"] = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    ns["rcos"], ns["rsin"] = randn(24, 4), randn(24, 4)
    return ns


@functools.cache
def _torch_names() -> dict:
    import torch

    import cuflash.torch  # noqa: F401  (cuflash.torch.attention in the examples)
    from cuflash.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    base = _numpy_names()
    ns = {"torch": torch, "flash_attn_func": flash_attn_func, "flash_attn_varlen_func": flash_attn_varlen_func}
    for name in ("q", "k", "v", "qp", "kp", "vp", "cu_q", "cu_k"):
        ns["t" + name] = torch.from_numpy(base[name].copy())
    return ns


@functools.cache
def _jax_names() -> dict:
    import jax
    import jax.numpy as jnp

    import cuflash.jax  # noqa: F401

    cpu = jax.devices("cpu")[0]  # also where a GPU is the default: the rows follow the CPU rules
    base = _numpy_names()
    ns = {"jax": jax, "jnp": jnp}
    for name in ("q", "k", "v", "qp", "kp", "vp", "cu_q", "cu_k"):
        ns["j" + name] = jax.device_put(base[name], cpu)
    return ns


@functools.cache
def _gpu_names(count: int) -> dict:
    import cupy

    base = _numpy_names()
    ns = {"cupy": cupy}
    ns["cq"], ns["ck"], ns["cv"] = (cupy.asarray(base[n], dtype=cupy.float16) for n in ("q", "k", "v"))
    ns["cout"], ns["clse"] = cuflash.attention(ns["cq"], ns["ck"], ns["cv"], return_lse=True)
    ns["cdout"] = cupy.ones_like(ns["cout"])
    if count >= 2:
        with cupy.cuda.Device(1):
            ns["ck1"], ns["cv1"] = cupy.asarray(ns["ck"]), cupy.asarray(ns["cv"])
    return ns


def test_the_error_table_is_there():
    assert len(ROWS) >= 80, f"the error table has only {len(ROWS)} rows"
    unknown = [(line, raises) for line, _, _, raises, _ in ROWS
               if not (isinstance(getattr(builtins, raises, None), type)
                       and issubclass(getattr(builtins, raises), BaseException))]
    assert not unknown, f"rows naming no built-in exception: {unknown}"


@pytest.mark.parametrize("line,what,example,raises,message", ROWS,
                         ids=[f"line{row[0]}" for row in ROWS])
def test_error_table_row(line, what, example, raises, message):
    expression, gpus, needs = _requirements(example)
    if "torch" in needs and not _has_torch():
        pytest.skip("torch is not installed")
    if "jax" in needs and not _has_jax():
        pytest.skip("JAX (0.7 or newer) is not installed")
    if _gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s); CuPy sees {_gpu_count()}")
    if gpus and "torch" in needs:
        import torch
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA build of torch")
    namespace = dict(_numpy_names())
    if "torch" in needs:
        namespace.update(_torch_names())
    if "jax" in needs:
        namespace.update(_jax_names())
    if gpus:
        namespace.update(_gpu_names(_gpu_count()))
    expected = getattr(builtins, raises)
    code = compile(expression, f"docs/api.md:{line}", "eval")
    try:
        result = eval(code, namespace)
    except Exception as e:  # noqa: BLE001 - the row names the exact type
        assert type(e) is expected, (f"docs/api.md:{line} ({what}): {expression} raised {type(e).__name__}: {e}; "
                                     f"the doc says {raises}")
        assert message in str(e), (f"docs/api.md:{line} ({what}): {expression} raised {raises} "
                                   f"without {message!r} in its message: {e}")
    else:
        pytest.fail(f"docs/api.md:{line} ({what}): {expression} returned {type(result).__name__}; "
                    f"the doc says it raises {raises}")


# -- signatures and parameters ------------------------------------------------------------------


def _public_functions() -> list[tuple[str, object]]:
    """(the name the doc uses, the Python function whose signature it documents)."""
    found = [(f"cuflash.{name}", getattr(cuflash, name)) for name in cuflash.__all__]
    modules = []
    if _has_torch():
        modules += [("cuflash.torch", "cuflash.torch."), ("cuflash.flash_attn_interface", "")]
    if _has_jax():
        modules.append(("cuflash.jax", "cuflash.jax."))
    for module_name, prefix in modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.isfunction(obj):  # a torch custom op: document the function it wraps, beside it
                obj = getattr(importlib.import_module("cuflash.torch.calls"), "_" + name)
            found.append((prefix + name, obj))
    return found


FUNCTIONS = _public_functions()


def _plain_signature(fn) -> str:
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _sections() -> list[tuple[str, list[str], str]]:
    """(heading, the section's fenced code blocks, its text outside them) for each heading."""
    sections, heading, blocks, prose, block = [], "", [], [], None
    for line in doc().splitlines():
        if block is not None:
            if line.startswith("```"):
                blocks.append("\n".join(block))
                block = None
            else:
                block.append(line)
        elif line.startswith("```"):
            block = []
        elif line.startswith("#"):
            sections.append((heading, blocks, "\n".join(prose)))
            heading, blocks, prose = line, [], []
        else:
            prose.append(line)
    sections.append((heading, blocks, "\n".join(prose)))
    return sections


def _documented_signature(name: str) -> tuple[str, str, str]:
    """(heading, documented signature, prose) of the section whose code block calls name(...)."""
    call = re.compile(rf"(?<![\w.]){re.escape(name)}\(")
    found = []
    for heading, blocks, prose in _sections():
        for block in blocks:
            m = call.search(block)
            if m:
                depth, i = 0, m.end() - 1
                for i in range(m.end() - 1, len(block)):
                    depth += {"(": 1, ")": -1}.get(block[i], 0)
                    if depth == 0:
                        break
                found.append((heading, block[m.end() - 1:i + 1], prose))
    assert len(found) == 1, f"{name}(...) must appear in exactly one code block of docs/api.md, found {len(found)}"
    return found[0]


def test_every_public_name_is_in_the_doc():
    missing = [name for name, _ in FUNCTIONS if not re.search(rf"(?<![\w.]){re.escape(name)}\b", doc())]
    assert not missing, f"docs/api.md does not mention {missing}"


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_signature_and_parameters_are_documented(name, fn):
    heading, documented, prose = _documented_signature(name)
    actual = _plain_signature(fn)
    assert _squash(documented) == _squash(actual), (f"docs/api.md ({heading}) documents {name}{documented}, "
                                                    f"the code has {name}{actual}")
    spans = " ".join(re.findall(r"`([^`]+)`", prose))
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"(?<!\w){p}(?!\w)", spans)]
    assert not missing, f"the section {heading!r} of docs/api.md does not describe {name}'s {missing}"


# -- command line and environment ---------------------------------------------------------------


def _help(*argv: str, capsys) -> str:
    from cuflash.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_command_and_option_is_documented(capsys):
    section = doc().split("## Command line", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"\{([\w,]+)\}", _help(capsys=capsys))[1].split(",")
    assert commands, "no subcommands found in python -m cuflash --help"
    missing = []
    for command in commands:
        if f"`{command}" not in section:
            missing.append(command)
        options = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", _help(command, capsys=capsys))) - {"--help"}
        missing += [f"{command} {option}" for option in sorted(options) if option not in section]
    assert not missing, f"the command line section of docs/api.md does not name {missing}"


def test_every_environment_variable_is_documented():
    names = set()
    for path in (ROOT / "cuflash").rglob("*.py"):  # the subpackages' modules too
        names |= set(re.findall(r"environ\.get\(\s*[\"']([A-Z_][A-Z0-9_]*)", path.read_text(encoding="utf-8")))
        names |= set(re.findall(r"getenv\(\s*[\"']([A-Z_][A-Z0-9_]*)", path.read_text(encoding="utf-8")))
    assert names, "found no environment variable read by cuflash"
    section = doc().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = sorted(name for name in names if f"`{name}`" not in section)
    assert not missing, f"the environment variables section of docs/api.md does not name {missing}"
