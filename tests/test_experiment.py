"""The experiments' hook (cuflash.experiment.override): inside the block the planner and the
compiler see the values given, on leaving the package's own come back, whatever happened
inside (no GPU needed)."""
import numpy as np
import pytest

from cuflash import _arrays, _compile, _kernels, _options, _plan, experiment


def _forward_plan(q_shape, kv_shape, causal=False):
    q, k, v = (_arrays.inspect(np.empty(s, np.float16), n) for n, s in (("q", q_shape), ("k", kv_shape),
                                                                          ("v", kv_shape)))
    options = _options.make_options(q, k, causal, None, (-1, -1), 0.0, None, 0.0, None, 0, backward=False)
    return _plan.forward(q, k, v, _arrays.inspect(np.empty(q_shape, np.float16), "out"), options, None,
                         _plan.shared_memory_limit("sm_90a"), True, 132)


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


def test_an_error_inside_leaves_nothing_behind():
    sources = _compile.CUDA_DIR
    with pytest.raises(RuntimeError, match="inside"):
        with experiment.override(patches={"fwd.cu": lambda text: text + "\n// patched\n"}, clusters=False):
            assert _compile.CUDA_DIR != sources and "// patched" in _compile._sources()["fwd.cu"].decode()
            assert not _kernels.clusters(0)
            raise RuntimeError("inside")
    assert _compile.CUDA_DIR == sources and "// patched" not in _compile._sources()["fwd.cu"].decode()
    assert _kernels.clusters is not None


def test_unknown_names_are_refused():
    with pytest.raises(ValueError):
        with experiment.override(tiles={"no such kind": {}}):
            pass
    with pytest.raises(ValueError):
        with experiment.override(patches={"no/such.cu": str}):
            pass
