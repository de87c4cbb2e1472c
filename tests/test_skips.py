"""The suite says why it skips: an optional dependency's skip names what to install,
and pytest lists every skip's reason in its summary."""
import re
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_importorskip_names_its_reason():
    for path in sorted(set(TESTS.glob("test_*.py")) - {Path(__file__)}):
        for call in re.findall(r"importorskip\(([^)]*)\)", path.read_text()):
            assert "reason=" in call, f"{path.name}: importorskip({call}) says no reason"


def test_skip_reasons_are_in_the_summary():
    config = (TESTS.parent / "pyproject.toml").read_text()
    addopts = re.search(r'^addopts = "(.*)"$', config, re.M)
    assert addopts and "-rs" in addopts[1].split()
