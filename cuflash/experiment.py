"""Experiments on the planner's choices and the kernels' sources, through one hook, and a
view of the launches they make.

    from cuflash import experiment

    with experiment.override(sm90_tiles={128: (128, 3, 2)}):
        cuflash.attention(q, k, v)             # planned with d 128's sm_90a tile replaced
    with experiment.override(sources="build/ab/before"):
        cuflash.attention_with_kvcache(...)    # compiled from another copy of cuflash/cuda
    with experiment.override(patches={"sm90/fwd.cu": add_trace_points}):
        ...                                    # compiled from a copy of the sources, patched
    with experiment.observe_launches(lambda pointers, stream: seen.append(stream)):
        cuflash.attention(q, k, v)             # each kernel launch's array pointers and stream seen

Inside an ``override`` block every call is planned, compiled and launched with the values
given; on leaving it the package's own come back. Entering and leaving forget every plan,
launcher and warm call made meanwhile (and, where the sources change, every loaded
kernel), so that no call inside reuses one made outside, nor the other way round. Compiled
kernels go through the kernel cache as always: its key covers every source byte, so a copy
or patch of the sources gets entries of its own.

For the developer tools (``scripts/``), which time or check candidates for the tables the
planner reads; not for applications: not thread-safe, and the values are not checked
beyond what planning and compiling do.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from . import _compile, _kernels, _plan, api, kvcache


@contextlib.contextmanager
def override(*, sources: str | Path | None = None, patches: dict[str, Callable[[str], str]] | None = None,
             tiles: dict[str, dict[int, tuple]] | None = None, sm90_tiles: dict[int, tuple] | None = None,
             sm90_banded_tiles: dict[int, tuple] | None = None,
             sm90_banded_extras_tiles: dict[int, tuple] | None = None,
             sm90_short_causal_tiles: dict[int, tuple] | None = None,
             sm90_mods_tiles: dict[int, tuple] | None = None, sm90_mask_tiles: dict[int, tuple] | None = None,
             sm90_mask_tensor_tiles: dict[int, tuple] | None = None,
             sm90_backward_extras_tiles: dict[int, tuple] | None = None,
             sm90_backward_dense_tiles: dict[int, tuple] | None = None,
             sm90_backward_dense_band_rows: int | None = None,
             sm90_wide_backward_buckets: tuple[int, ...] | None = None,
             sm90_backward_section_bytes: int | None = None, sm90_section_bytes: int | None = None,
             sm90_section_rows: int | None = None,
             sm90_tail: Callable[[int, int, int], tuple[int, int]] | None = None,
             tile_group: Callable[[object, int, object], int] | None = None, shared_limit: int | None = None,
             clusters: bool | None = None, dependent_launches: bool | None = None) -> Iterator[None]:
    """Plan, compile and launch the calls made inside the block with these values in place
    of the package's (None: the package's own).

    sources: a folder holding a copy of ``cuflash/cuda`` to compile every kernel from.
    patches: source name under ``cuda/`` (``"sm90/fwd.cu"``, ``"decode/split_kv.cu"``) ->
        a function from its text to the text to compile instead (of ``sources``' copy
        where both are given).
    tiles: kind (``"forward"``, ``"backward_dq"``, ``"decode"``, ...; ``_plan.KINDS``) ->
        {head-dim bucket: its candidate tiles, preferred first (``_plan.Tile`` values; a
        single Tile stands for one candidate)}.
    sm90_tiles, sm90_banded_tiles, sm90_banded_extras_tiles, sm90_short_causal_tiles:
        {head dim: (keys a tile, stages, consumers)} entries of the sm_90a forward's tables
        (``_plan.SM90_TILES``: no mask; under a mask or window; with extras too; short
        causal calls).
    sm90_mods_tiles: {head dim: (keys a tile, stages, consumers)} of the sm_90a forward for
        calls with score_mod / mask_mod (``_plan.SM90_MODS_TILES``; a head dim it names
        takes them there rather than on the mma.sync forward).
    sm90_mask_tiles, sm90_mask_tensor_tiles: {head dim: (keys a tile, stages, consumers)} of
        the sm_90a forward for calls with mask_mod alone and its block mask
        (``_plan.SM90_MASK_TILES``; where the mask reads mod tensors
        ``_plan.SM90_MASK_TENSOR_TILES``).
    sm90_backward_extras_tiles: {head dim: (query rows a step, stages)} of the sm_90a
        backward for calls with softcap, ALiBi, dropout or mods
        (``_plan.SM90_BACKWARD_EXTRAS_TILES``; the head dims it takes them at).
    sm90_backward_dense_tiles: {head dim: (query rows a step, stages)}, the whole table of
        the sm_90a backward's tiles for dense calls whose rows come in eights, without
        extras (``_plan.SM90_BACKWARD_DENSE_TILES``; ``{}``: those calls on
        ``_plan.SM90_BACKWARD_TILES``).
    sm90_backward_dense_band_rows: under a causal mask or a window, the query rows a key block
        must see for those tiles (``_plan.SM90_BACKWARD_DENSE_BAND_ROWS``; 0: every band).
    sm90_wide_backward_buckets: the head-dim buckets whose calls take the wide sm_90a
        backward (``_plan.SM90_WIDE_BACKWARD_BUCKETS``; ``()``: none, the mma.sync backward).
    sm90_backward_section_bytes: the L2 bytes of the sm_90a backwards' groups of pairs
        under a causal mask or a window (``_plan.backward_section``).
    sm90_section_bytes, sm90_section_rows: the sm_90a causal scheduler's sections
        (``_plan.sm90_section``).
    sm90_tail: ``(tiles, key_tiles, multiprocessors) -> (tail_start, tail_ctas)``, in
        place of ``_plan.sm90_tail`` (e.g. ``lambda tiles, *_: (tiles, 0)``: the last wave
        left whole).
    tile_group: ``(kernel, pairs, device) -> pairs a group`` of the tile-major order of
        banded grids, in place of ``_plan.tile_group`` (e.g. ``lambda kernel, pairs, device:
        min(3, pairs)``: groups of 3 (head, batch) pairs, the last one partial).
    shared_limit: the opt-in shared memory per block, in bytes, the planner takes the device
        to have (another arch's: ``_plan.shared_memory_limit("sm_86")``), so that the
        tiles of a smaller device run here.
    clusters: False merges the KV-cache call's splits in the merge kernel, never in a
        thread block cluster (True: as the device allows, the package's way).
    dependent_launches: False launches a plan's kernels one after the other, never as
        programmatic dependents (True: as the device allows).
    """
    with contextlib.ExitStack() as undo:
        undo.callback(_forget_plans)  # (the first callback: runs last, once the package's values are back)
        if sources is not None or patches:
            undo.enter_context(_sources(Path(sources) if sources is not None else _compile.CUDA_DIR, patches or {}))
        for kind, entries in (tiles or {}).items():
            if kind not in _plan.KINDS:
                raise ValueError(f"tiles: expected kinds among {', '.join(_plan.KINDS)}, got {kind!r}")
            table = _plan.KINDS[kind].tiles
            undo.enter_context(_entries(table, {d: (t,) if isinstance(t, _plan.Tile) else tuple(t)
                                                for d, t in entries.items()}))
        for table, entries in ((_plan.SM90_TILES, sm90_tiles), (_plan.SM90_BANDED_TILES, sm90_banded_tiles),
                               (_plan.SM90_BANDED_EXTRAS_TILES, sm90_banded_extras_tiles),
                               (_plan.SM90_SHORT_CAUSAL_TILES, sm90_short_causal_tiles),
                               (_plan.SM90_MODS_TILES, sm90_mods_tiles), (_plan.SM90_MASK_TILES, sm90_mask_tiles),
                               (_plan.SM90_MASK_TENSOR_TILES, sm90_mask_tensor_tiles),
                               (_plan.SM90_BACKWARD_EXTRAS_TILES, sm90_backward_extras_tiles)):
            if entries:
                undo.enter_context(_entries(table, {d: tuple(tile) for d, tile in entries.items()}))
        wide_buckets = None if sm90_wide_backward_buckets is None else tuple(sm90_wide_backward_buckets)
        for name, value in (("SM90_BACKWARD_SECTION_BYTES", sm90_backward_section_bytes),
                            ("SM90_SECTION_BYTES", sm90_section_bytes), ("SM90_SECTION_ROWS", sm90_section_rows),
                            ("SM90_WIDE_BACKWARD_BUCKETS", wide_buckets), ("sm90_tail", sm90_tail),
                            ("SM90_BACKWARD_DENSE_TILES", sm90_backward_dense_tiles),
                            ("SM90_BACKWARD_DENSE_BAND_ROWS", sm90_backward_dense_band_rows),
                            ("tile_group", tile_group)):
            if value is not None:
                undo.enter_context(_rebound(_plan, name, value))
        given = {name: False for name, allowed in (("clusters", clusters), ("dependent_launches", dependent_launches))
                 if allowed is False}
        if shared_limit is not None:
            given["shared_limit"] = shared_limit
        if given:  # (the device's facts as the planner takes them, these replaced)
            facts = _kernels.device_facts
            undo.enter_context(_rebound(_kernels, "device_facts", lambda device: facts(device)._replace(**given)))
        _forget_plans()
        yield


@contextlib.contextmanager
def observe_launches(observer: Callable[[tuple, int], None]) -> Iterator[None]:
    """Inside the block, ``observer(pointers, stream)`` before every kernel launch: the array
    pointers its Params hold and the stream it goes to (zero-copy and stream-order checks).
    Plans, launchers and warm calls are kept: the launches seen are those of the package's
    own values."""
    saved = _kernels.launch_observer
    _kernels.launch_observer = observer
    try:
        yield
    finally:
        _kernels.launch_observer = saved


def _forget_plans() -> None:
    """Forget what was planned (and launchers and warm calls hold) under other values."""
    _plan.kernel.cache_clear()
    _kernels._launchers.clear()
    api._warm.clear()
    kvcache._warm.clear()


def _forget_kernels() -> None:
    """Forget the sources read and the kernels loaded from them."""
    _compile._sources.cache_clear()
    _compile.load_kernel.cache_clear()
    _compile.resident_ctas.cache_clear()


@contextlib.contextmanager
def _sources(folder: Path, patches: dict[str, Callable[[str], str]]) -> Iterator[None]:
    """Compile from ``folder`` (a copy of cuflash/cuda), with ``patches`` applied to a copy."""
    if not folder.is_dir():
        raise ValueError(f"sources: {folder} is not a folder (a copy of cuflash/cuda)")
    saved = _compile.CUDA_DIR
    with contextlib.ExitStack() as stack:
        if patches:
            copy = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cuflash-cuda-"))) / "cuda"
            shutil.copytree(folder, copy)
            for name, patch in patches.items():
                path = copy / name
                if not path.is_file():
                    raise ValueError(f"patches: no source {name!r} under {folder}")
                path.write_text(patch(path.read_text(encoding="utf-8")), encoding="utf-8")
            folder = copy
        _compile.CUDA_DIR = folder
        _forget_kernels()
        try:
            yield
        finally:
            _compile.CUDA_DIR = saved
            _forget_kernels()


@contextlib.contextmanager
def _entries(table: dict, entries: dict) -> Iterator[None]:
    """``table`` with ``entries`` in it, changed in place (every module holding it sees them)."""
    saved = dict(table)
    table.update(entries)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


@contextlib.contextmanager
def _rebound(owner, name: str, value) -> Iterator[None]:
    """``name`` bound to ``value`` in the module ``owner`` and every module of it (a package)
    that binds it to the same object: the module defining it and those importing it by name."""
    original = getattr(owner, name)
    prefix = owner.__name__ + "."
    holders = [m for key, m in list(sys.modules.items())
               if (key == owner.__name__ or key.startswith(prefix)) and vars(m).get(name) is original]
    for module in holders:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, name, original)
