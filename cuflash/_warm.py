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

from . import _arrays

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
