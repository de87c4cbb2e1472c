"""Warm calls: a call signature that passed the checks once passes them again.

Every user error becomes an exception before anything runs (``_options``). A warm call
skips the checks and the planning and launches what its signature launched the first
time. Its key holds each array's signature (library, device, shape, strides, dtype and
16-byte alignment, read in the fewest of its library's own calls: ``_arrays.signature``)
and every other argument beside its type (True, 1 and 1.0 are one key to a dict, not to
the checks). Arrays without a signature (NumPy, JAX: each call waits for them) make no
key, nor do arguments that cannot be hashed (a list for a window): such calls are
checked and planned every time. Each front end keeps a table of its own (api, kvcache,
torch's checked scalars, and the launchers ``_kernels`` binds for JAX and the torch
glue), through ``lookup`` and ``remember``.
"""
from __future__ import annotations

from . import _arrays, mod

LIMIT = 4096  # signatures a table keeps (a program calls with a few; one that makes new ones forever stops adding)


def key(arrays: tuple, scalars: tuple, pair: int | None = None):
    """The key of a call on ``arrays`` with the other arguments ``scalars``, or None.
    ``pair``: the index in scalars of a (left, right) pair whose items' types count too."""
    signatures = tuple(map(_arrays.signature, arrays))
    if None in signatures:
        return None
    try:
        kinds = tuple(map(type, scalars))
        return signatures, scalars, kinds if pair is None else (kinds, *map(type, scalars[pair]))
    except TypeError:  # (a window that is no pair: the checks say what is wrong with it)
        return None


def mods_key(key, score_mod, mask_mod, mod_tensors: tuple, block_mask):
    """``key`` for a call with score_mod / mask_mod (and their tensors and block mask), or
    None. The kernels' parameters hold the mod tensors' and the block mask's addresses, so
    their pointers count beside their signatures; the functions count as what their traces
    read (``cuflash.mod.watched``: a global they name, changed, makes another key and
    another trace; a lambda made anew each call with the same values, the same key)."""
    if key is None or mod_tensors.__class__ not in (tuple, list):
        return None
    functions = tuple(None if f is None else mod.watched(f) or 0 for f in (score_mod, mask_mod))
    arrays = (*mod_tensors, *(() if block_mask is None else (block_mask.statuses,)))
    signatures = tuple(map(_arrays.signature, arrays))
    if None in signatures or 0 in functions:
        return None
    pointers = tuple(_arrays.library(a).pointer(a) for a in arrays)
    made_for = None if block_mask is None else (block_mask.batch, block_mask.heads, block_mask.seqlen_q,
                                                 block_mask.seqlen_k)
    return key, functions, signatures, pointers, made_for


def lookup(table: dict, key):
    """The entry kept for ``key``, or None."""
    try:
        return table.get(key)
    except TypeError:  # an argument that cannot be hashed
        return None


def remember(table: dict, key, entry) -> None:
    if key is not None and len(table) < LIMIT:
        try:
            table.setdefault(key, entry)
        except TypeError:
            pass
