"""Run flash-attn's own tests/test_flash_attn.py against cuflash.flash_attn_interface.

    python scripts/common/flash_attn_tests.py /path/to/flash-attention [pytest arguments]
    python scripts/common/flash_attn_tests.py ../flash-attention -n 16 -k "varlen_causal or block_table_bounds"
    python scripts/common/flash_attn_tests.py ../flash-attention --sample 200 -n 16

The file holds about 509,000 cases (304,128 of them test_flash_attn_kvcache): hours on one GPU.
``--sample N`` keeps N cases of each test function, drawn with a fixed seed (the same on every
pytest-xdist worker), and every case of a function that has N or fewer.

Builds, in a temporary folder, a ``flash_attn`` package whose names are cuflash's (its
``flash_attn_interface`` re-exports ``cuflash.flash_attn_interface``, the internal functions,
``_get_block_size_n`` and ``USE_TRITON_ROCM`` included), copies in flash-attn's own
``bert_padding`` and rotary helpers from the checkout (the tests import them; they are
flash-attn's code, used as they are), copies the test file beside it and runs pytest there
with this cuflash first on the path. Needs a CUDA GPU, torch, einops and triton (flash-attn's
rotary helper). flash-attn's test of its C++ binding's arguments
(``test_flash_attn_generator_arg_must_be_none``, which calls ``flash_attn_gpu`` directly) is
left out: cuflash has no such binding.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# flash-attn's files the test file imports besides the interface: (path in the checkout, path in the package)
HELPERS = (("flash_attn/bert_padding.py", "bert_padding.py"), ("flash_attn/layers/rotary.py", "layers/rotary.py"),
           ("flash_attn/ops/triton/rotary.py", "ops/triton/rotary.py"))
NOT_CUFLASH = ("test_flash_attn_generator_arg_must_be_none",)

PACKAGE_INIT = '''"""flash-attn's public names, answered by cuflash (scripts/common/flash_attn_tests.py)."""
__version__ = "2.8.4"
from cuflash.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                          flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                          flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
'''
INTERFACE = '''from cuflash.flash_attn_interface import *  # noqa: F401,F403
from cuflash.flash_attn_interface import (USE_TRITON_ROCM, _flash_attn_backward, _flash_attn_forward,  # noqa: F401
                                          _flash_attn_varlen_backward, _flash_attn_varlen_forward,
                                          _get_block_size_n)
'''


# A conftest for the built folder: --sample's stratified draw, applied after collection.
SAMPLE_CONFTEST = '''import collections, os, random


def pytest_collection_modifyitems(config, items):
    size = int(os.environ.get("CUFLASH_FLASH_ATTN_SAMPLE", "0"))
    if not size:
        return
    groups = collections.defaultdict(list)
    for item in items:
        groups[item.originalname].append(item)
    draw = random.Random(0)
    keep = set()
    for name in sorted(groups):
        group = groups[name]
        keep.update(map(id, group if len(group) <= size else draw.sample(group, size)))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = [item for item in items if id(item) in keep]


def pytest_runtest_logreport(report):
    path = os.environ.get("CUFLASH_FLASH_ATTN_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = crash.message if crash is not None else str(report.longrepr)
    with open(path, "a") as failures:
        failures.write(f"{report.nodeid} ({report.when}): {why.splitlines()[0][:300] if why else ''}\\n")
'''


def build(checkout: Path, folder: Path) -> None:
    """The flash_attn package and the test file in ``folder``."""
    package = folder / "flash_attn"
    for sub in ("", "layers", "ops", "ops/triton"):
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").touch()
    (package / "__init__.py").write_text(PACKAGE_INIT)
    (package / "flash_attn_interface.py").write_text(INTERFACE)
    for source, target in HELPERS:
        shutil.copyfile(checkout / source, package / target)
    shutil.copyfile(checkout / "tests" / "test_flash_attn.py", folder / "test_flash_attn.py")
    (folder / "conftest.py").write_text(SAMPLE_CONFTEST)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a flash-attention source checkout (tests/, flash_attn/)")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="N cases of each test function, drawn with a fixed seed (0: every case)")
    parser.add_argument("--failures", type=Path, metavar="FILE",
                        help="append each failing case and its error to FILE as it fails")
    args, pytest_args = parser.parse_known_args()
    if not (args.checkout / "tests" / "test_flash_attn.py").is_file():
        parser.error(f"{args.checkout} holds no tests/test_flash_attn.py")
    with tempfile.TemporaryDirectory(prefix="cuflash-flash-attn-tests-") as folder:
        build(args.checkout, Path(folder))
        deselect = [f"--deselect=test_flash_attn.py::{name}" for name in NOT_CUFLASH]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), folder, os.environ.get("PYTHONPATH", "")]),
                   CUFLASH_FLASH_ATTN_SAMPLE=str(args.sample),
                   CUFLASH_FLASH_ATTN_FAILURES=str(args.failures.resolve()) if args.failures else "")
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *deselect, *pytest_args],
                                 cwd=folder, env=env)
        # An interrupt (Ctrl-C, timeout -s INT) goes on to pytest, which stops and prints its summary.
        signal.signal(signal.SIGINT, lambda number, frame: tests.send_signal(signal.SIGINT))
        return tests.wait()


if __name__ == "__main__":
    sys.exit(main())
