"""The experiments' hook (cuflash.experiment.override): inside the block the planner and the
compiler see the values given, on leaving the package's own come back, whatever happened
inside (no GPU needed)."""
import numpy as np
import pytest

from cuflash import _arrays, _compile, _kernels, _options, _plan, experiment
from cuflash._params import Params

from .test_device import gpus  # noqa: F401 (a fixture)
from .test_plan import device


def _forward_plan(q_shape, kv_shape, causal=False, sm90a=True):
    q, k, v = (_arrays.inspect(np.empty(s, np.float16), n) for n, s in (("q", q_shape), ("k", kv_shape),
                                                                          ("v", kv_shape)))
    options = _options.make_options(q, k, causal, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    return _plan.forward(q, k, v, _arrays.inspect(np.empty(q_shape, np.float16), "out"), options, None,
                         device(_plan.shared_memory_limit("sm_90a"), 132, sm90a=sm90a, resident_ctas=lambda kernel: 2))


def test_the_values_given_hold_inside_and_go_after():
    tile = _plan.Tile(64, 32, 4, 1)
    before = (_plan.KINDS["forward"].tiles[128], dict(_plan.SM90_TILES), _plan.sm90.SM90_SECTION_ROWS)
    with experiment.override(tiles={"forward": {128: tile}}, sm90_tiles={128: (128, 3, 2)},
                             sm90_section_rows=1, sm90_tail=lambda tiles, key_tiles, sms: (tiles, 0)):
        assert _plan.KINDS["forward"].tiles[128] == (tile,)
        assert _plan.kernel("forward", "float16", 128, False, True, False, 10**6).tile == tile
        (step,) = _forward_plan((1, 4096, 16, 128), (1, 4096, 16, 128)).steps
        assert (step.kernel.block_n, step.kernel.stages, step.kernel.consumers) == (128, 3, 2)
        assert _plan.sm90.SM90_SECTION_ROWS == 1
    assert (_plan.KINDS["forward"].tiles[128], dict(_plan.SM90_TILES), _plan.sm90.SM90_SECTION_ROWS) == before
    assert _plan.kernel("forward", "float16", 128, False, True, False, 10**6).tile != tile


def test_the_tile_groups_given_hold_inside():
    """A causal mma.sync forward's (head, batch) pairs per tile-major group: the planner's
    (a quarter of the resident CTAs: 132 x 2 / 4), or the function given."""
    def groups():
        return Params.from_buffer_copy(_forward_plan((2, 512, 48, 96), (2, 512, 48, 96), True, False).params).tile_group

    assert groups() == 48  # (96 pairs in 2 groups of 66 at most)
    with experiment.override(tile_group=lambda kernel, pairs, device: min(7, pairs)):
        assert groups() == 7
    assert groups() == 48


def test_an_error_inside_leaves_nothing_behind(gpus):  # noqa: F811 (the fixture)
    sources = _compile.CUDA_DIR
    with pytest.raises(RuntimeError, match="inside"):
        with experiment.override(patches={"fwd.cu": lambda text: text + "\n// patched\n"}, clusters=False,
                                 shared_limit=1024):
            assert _compile.CUDA_DIR != sources and "// patched" in _compile._sources()["fwd.cu"].decode()
            facts = _kernels.device_facts(0)
            assert not facts.clusters and facts.dependent_launches and facts.shared_limit == 1024
            raise RuntimeError("inside")
    assert _compile.CUDA_DIR == sources and "// patched" not in _compile._sources()["fwd.cu"].decode()
    facts = _kernels.device_facts(0)
    assert facts.clusters and facts.shared_limit == 232448


def test_unknown_names_are_refused():
    with pytest.raises(ValueError):
        with experiment.override(tiles={"no such kind": {}}):
            pass
    with pytest.raises(ValueError):
        with experiment.override(patches={"no/such.cu": str}):
            pass
