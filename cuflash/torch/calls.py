"""PyTorch's calls: the torch.library custom ops, their fake implementations and autograd
formulas, and the functions ``cuflash.torch`` exports (its docstring tells how they fit).

Importing this module imports torch; ``import cuflash`` alone does not.
"""
import hashlib
import math
from typing import Optional

import numpy as np
import torch

from .. import _arrays, _options, _warm, api, kvcache

_UINT64 = 2**64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None, deterministic: bool = False, *,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              seed: Optional[int] = None, return_lse: bool = False, score_mod=None, mask_mod=None,
              mod_tensors=(), block_mask=None):
    """Differentiable ``cuflash.attention`` for torch tensors: returns out, or (out, lse)
    with ``return_lse`` (lse float32 (batch, nheads, seqlen_q), differentiable too).

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim);
    see ``cuflash.attention`` for the semantics of the options. ``deterministic`` makes
    the backward bitwise reproducible (dq accumulated in a fixed order) at some cost in
    speed. ``seed=None`` with dropout draws one from torch's generator (see
    ``cuflash.torch``). ``score_mod``, ``mask_mod`` and ``mod_tensors`` (tensors on q's
    device that get no gradient) as ``cuflash.attention``; see ``cuflash.torch`` for how
    they reach the ops.
    ``block_mask``: a ``cuflash.mod.BlockMask`` made with ``like=q`` (its statuses a tensor
    on q's device), which carries mask_mod and mod_tensors, as ``cuflash.attention``.
    """
    if block_mask is not None:
        mask_mod, mod_tensors = _block_mask_mods(block_mask, mask_mod, mod_tensors)
    mods = _options.has_mods(score_mod, mask_mod, mod_tensors)
    step_key = None
    if alibi_slopes is None and not mods and q.__class__ is torch.Tensor and deterministic.__class__ is bool:
        if not _tracked(q, k, v):  # inference on a signature that ran: straight to its launch
            result = api.warm_forward(q, k, v, (causal, softmax_scale, window_size, softcap, dropout_p, seed, 0,
                                                return_lse))
            if result is not None:
                return result
        elif seed is None and return_lse.__class__ is bool and not torch.compiler.is_compiling():
            # Training, eagerly: a signature that ran takes its step (_Step) with no check.
            step_key = api._key((q, k, v), (causal, softmax_scale, window_size, softcap, dropout_p, deterministic,
                                            _Step), None)
            step = _warm.lookup(api._warm, step_key)
            if step is not None:
                out, lse = _Steps.apply(q, k, v, step)
                return (out, lse) if return_lse else out
    _options.check_bool("return_lse", return_lse)
    args = _op_options(dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, **_mod_tensor_names(mods, mod_tensors)),
                       causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                       seed=seed)
    if step_key is not None:  # (no dropout: api._key makes no key for a call with it)
        step = _Step(args)
        out, lse = _Steps.apply(q, k, v, step)
        if step.forward is not None:  # (CUDA tensors: a CPU call is not kept)
            _warm.remember(api._warm, step_key, step)
        return (out, lse) if return_lse else out
    if mods:
        args = (*args, *_mod_arguments(score_mod, mask_mod, mod_tensors))
        if block_mask is not None:
            args = (*args, _block_statuses(block_mask, q, k, v))
    if _tracked(q, k, v):
        out, lse, _ = (_mod_forward if mods else _forward)(q, k, v, *args)
    else:
        out, lse, _ = _run_forward(q, k, v, *args, return_lse=return_lse)
    return (out, lse) if return_lse else out


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, deterministic: bool = False, *,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                     seed: Optional[int] = None, return_lse: bool = False,
                     block_table: Optional[torch.Tensor] = None, score_mod=None, mask_mod=None, mod_tensors=(),
                     block_mask=None):
    """Differentiable ``cuflash.attention_varlen`` for torch tensors: returns out, or
    (out, lse) with ``return_lse`` (lse float32 (nheads, total_q), differentiable too).

    q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim) packed; sequence
    b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v (int32 tensors (batch + 1,) on q's device). Gradients reach q, k and v.
    With ``block_table``, k and v are page pools (``cuflash.attention_varlen``): forward
    only, inputs that need no gradient (or under torch.no_grad()). ``score_mod``,
    ``mask_mod``, ``mod_tensors`` and ``block_mask`` as ``attention`` (b is the sequence
    index; a block mask made over (sequences, heads, max_seqlen_q, max_seqlen_k)).
    """
    if block_mask is not None:
        mask_mod, mod_tensors = _block_mask_mods(block_mask, mask_mod, mod_tensors)
    mods = _options.has_mods(score_mod, mask_mod, mod_tensors)
    if block_table is not None:
        if mods:
            raise NotImplementedError("score_mod and mask_mod do not take block_table (the paged call) yet")
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                             causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_lse)
    _options.check_bool("return_lse", return_lse)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
                   **_mod_tensor_names(mods, mod_tensors))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_op_options(
        tensors, max_seqlens=(max_seqlen_q, max_seqlen_k), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed=seed))
    if mods:
        args = (*args, *_mod_arguments(score_mod, mask_mod, mod_tensors))
        if block_mask is not None:
            args = (*args, _block_statuses(block_mask, q, k, v, (cu_seqlens_q.shape[0] - 1, max_seqlen_q,
                                                                 max_seqlen_k)))
    if _tracked(q, k, v):
        out, lse, _ = (_varlen_mod_forward if mods else _varlen_forward)(*args)
    else:
        out, lse, _ = _run_varlen_forward(*args, return_lse=return_lse)
    return (out, lse) if return_lse else out


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, **options):
    """The varlen call over a paged cache, forward only: on CUDA tensors the kernels, on
    CPU tensors NumPy views."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise ValueError("block_table: the varlen call over a paged cache is forward only; call it under "
                         "torch.no_grad() or on tensors that do not require grad")
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                   alibi_slopes=options.get("alibi_slopes"))
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors.values()):
        _refuse(tensors)
    if q.is_cuda:
        return api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    block_table=block_table, **options)
    arrays = dict(zip(tensors, _numpy(**tensors)))
    options["alibi_slopes"] = arrays.pop("alibi_slopes")
    result = api.attention_varlen(arrays["q"], arrays["k"], arrays["v"], arrays["cu_seqlens_q"],
                                  arrays["cu_seqlens_k"], max_seqlen_q, max_seqlen_k,
                                  block_table=arrays["block_table"], **options)
    return tuple(map(_tensor, result)) if options["return_lse"] else _tensor(result)


def _tracked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Does the call go through autograd or torch.compile? Otherwise (inference) it runs
    the kernels straight away, without the autograd.Function, the custom op or an LSE
    it does not return."""
    return torch.compiler.is_compiling() or torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad)


def _op_options(tensors: dict, *, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes, dropout_p,
                seed, max_seqlens=()) -> tuple:
    """The forward ops' arguments after ``q, k, v`` (and the packing: ``max_seqlens``),
    from a caller's values, checked as ``cuflash.attention`` checks them: a custom op's
    schema takes typed values, and converting first (float(True), int(1.5)) would hide a
    wrong one. The arrays themselves are checked by ``cuflash.attention`` when the op runs."""
    q = tensors["q"]
    device = q.device if isinstance(q, torch.Tensor) else None
    for t in tensors.values():
        if t is not None and not (isinstance(t, torch.Tensor) and t.device == device):
            _refuse(tensors)
    # The scalars' checks depend on nothing else: a warm call looks them up, keyed by the
    # values and their types (True, 1 and 1.0 are one key to a dict, not to the checks).
    values = (causal, softmax_scale, deterministic, window_size, softcap, dropout_p, seed, max_seqlens)
    try:
        key = (values, tuple(map(type, values)), tuple(map(type, window_size)))
        checked = _warm.lookup(_checked_scalars, key)
    except TypeError:  # unhashable, or window_size not a pair: the checks say what is wrong
        key = checked = None
    if checked is None:
        checked = _check_scalars(key, q, tensors["k"], *values)
    head, tail = checked
    return (*head, alibi_slopes, *tail)


_checked_scalars: dict = {}


def _check_scalars(key, q, k, causal, softmax_scale, deterministic, window_size, softcap, dropout_p, seed, max_seqlens):
    for name, value in zip(("max_seqlen_q", "max_seqlen_k"), max_seqlens):
        _options.check_integer(name, value, bits=31)
    seqlen_k = max_seqlens[1] if max_seqlens else (k.shape[1] if k.dim() == 4 else 0)
    options = _options.scalar_options(q.shape[-1] if q.dim() else 1, seqlen_k, causal=causal,
                                      softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                      dropout_p=dropout_p, seed=seed)
    _options.check_bool("deterministic", deterministic)
    left, right = window_size
    checked = ((options.causal, None if softmax_scale is None else options.scale, deterministic, int(left),
                int(right), options.softcap),
               (options.dropout_p, None if seed is None else _int64(options.seed)))
    _warm.remember(_checked_scalars, key, checked)
    return checked


def _refuse(tensors: dict):
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__qualname__}")
    devices = {name: str(t.device) for name, t in tensors.items() if t is not None}
    raise ValueError(f"tensors must be on one device, got {devices}")


# --- dense -----------------------------------------------------------------------------------


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       softmax_scale: Optional[float], deterministic: bool, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, seed: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, rng_state). ``deterministic`` is not used by the forward: autograd hands
    it to the backward, and it has to be an input of this op for setup_context to see it.
    rng_state is int64 [seed, rng_offset] on the CPU (zeros without dropout)."""
    out, lse, (seed, rng_offset) = _run_forward(q, k, v, causal, softmax_scale, deterministic, window_left,
                                                window_right, softcap, alibi_slopes, dropout_p, seed, return_lse=True)
    return out, lse, _rng_state(seed, rng_offset)


def _run_forward(q, k, v, causal, softmax_scale, deterministic, window_left, window_right, softcap, alibi_slopes,
                 dropout_p, seed, mods=None, mod_tensors=(), block_statuses=None, *, return_lse: bool):
    """(out, lse or None, (seed, rng_offset)): ``cuflash.attention`` on the tensors (CUDA)
    or on NumPy views of them (CPU), the dropout seed drawn as ``cuflash.torch`` says;
    ``mods`` the registry key of the call's score_mod / mask_mod (or None),
    ``block_statuses`` its block mask's statuses (or None)."""
    seed, rng_offset = _seed_and_offset(q, dropout_p, seed)
    if not q.is_cpu:  # (the keywords themselves: a dict of them merged in costs a microsecond a call)
        result = api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p, seed=seed, rng_offset=rng_offset, return_lse=return_lse,
                               **_mod_functions(mods, mod_tensors, block_statuses))
        out, lse = result if return_lse else (result, None)
        return out, lse, (seed, rng_offset)
    options = _api_options(causal, softmax_scale, window_left, window_right, softcap, dropout_p, seed, rng_offset)
    q, k, v, alibi_slopes, block_statuses = _numpy(q=q, k=k, v=v, alibi_slopes=alibi_slopes,
                                                   block_mask=block_statuses)
    out, lse = api.attention(q, k, v, alibi_slopes=alibi_slopes, return_lse=True, **options,
                             **_mod_functions(mods, _numpy_mod_tensors(mod_tensors), block_statuses))
    return _tensor(out), _tensor(lse), (seed, rng_offset)


attention_forward = torch.library.custom_op(
    "cuflash::attention_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))(_attention_forward)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, deterministic, window_left=-1, window_right=-1,
                            softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None):
    batch, seqlen_q, nheads, _ = q.shape
    # new_empty, not empty_like: the real outputs are contiguous whatever q's strides are.
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            _fake_rng_state())


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                        deterministic: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                        rng_state: Optional[torch.Tensor] = None, dlse: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): gradients of attention_forward's out (dout) and lse (dlse, or None
    where lse is unused), given its out, lse and rng_state."""
    return _run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, rng_state, dlse)


def _run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, rng_state, dlse, mods=None, mod_tensors=(), block_statuses=None):
    seed, rng_offset = _from_rng_state(rng_state)
    if not q.is_cpu:
        return tuple(api.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                            window_size=(window_left, window_right), softcap=softcap,
                                            alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                                            rng_offset=rng_offset, deterministic=deterministic, dlse=dlse,
                                            **_mod_functions(mods, mod_tensors, block_statuses)))
    options = _api_options(causal, softmax_scale, window_left, window_right, softcap, dropout_p, seed, rng_offset)
    *arrays, alibi_slopes, dlse, block_statuses = _numpy(dout=dout, q=q, k=k, v=v, out=out, lse=lse,
                                                         alibi_slopes=alibi_slopes, dlse=dlse,
                                                         block_mask=block_statuses)
    grads = api.attention_backward(*arrays, alibi_slopes=alibi_slopes, deterministic=deterministic, dlse=dlse,
                                   **options, **_mod_functions(mods, _numpy_mod_tensors(mod_tensors), block_statuses))
    return tuple(_tensor(g) for g in grads)


attention_backward = torch.library.custom_op("cuflash::attention_backward", mutates_args=())(_attention_backward)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left=-1,
                             window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                             dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, ctx.causal, ctx.softmax_scale, ctx.deterministic, ctx.window_left, ctx.window_right, ctx.softcap,
     alibi_slopes, ctx.dropout_p, _, *mods) = inputs  # (mods: the mod ops' key, tensors and block statuses)
    out, lse, rng_state = output
    ctx.mods = mods[0] if mods else None
    block_statuses = mods[2] if len(mods) > 2 else None
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, block_statuses, *(mods[1] if mods else ()))
    if rng_state is not None:  # (the eager call's, without dropout)
        ctx.mark_non_differentiable(rng_state)


def _backward(backward, ctx, dout, dlse, _drng_state):
    q, k, v, out, lse, alibi_slopes, rng_state, block_statuses, *mod_tensors = ctx.saved_tensors
    dout, dlse = _output_gradients(dout, dlse, out)
    blocks = () if block_statuses is None else (block_statuses,)
    dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic,
                          ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, rng_state,
                          dlse, *_mod_inputs(ctx, mod_tensors), *blocks)
    # (the mod ops' block_statuses gets no gradient either)
    return (dq, dk, dv) + (None,) * 9 + _mod_gradients(ctx, mod_tensors) + ((None,) if ctx.mods else ())


def _differentiable(op, run, backward_op, backward, setup_context, formula):
    """Give the custom op ``op`` its autograd ``formula`` (over ``backward_op``), and return
    op(*inputs) with autograd: the op while torch.compile traces; eagerly, ``run`` and the
    formula over ``backward`` (the ops' functions, ``run`` before its rng_state is made)
    through an autograd.Function, without the ops' per-call dispatch and output-aliasing checks
    (the ops' eager dispatch cost about 500 us a small training step)."""
    # One gradient an input the call passed (an optional input left at its default gets none).
    op.register_autograd(lambda ctx, *grads: formula(backward_op, ctx, *grads)[:len(ctx.needs_input_grad)],
                         setup_context=setup_context)

    # q, k and v, the inputs that get gradients, go to apply alone and every input in one
    # tuple beside them: apply's per-argument checks cost ~0.5 us an argument.
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, inputs):
            ctx.set_materialize_grads(False)  # no zero gradients made for unused lse and rng_state: ~100 us a step
            out, lse, (seed, rng_offset) = run(*inputs, return_lse=True)
            # Without dropout no rng_state tensor is made, saved and read back: the backward takes None alike.
            output = out, lse, None if seed is None and rng_offset == 0 else _rng_state(seed, rng_offset)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            if grads[0] is None and grads[1] is None:  # out's and lse's gradients are undefined: so are the inputs'
                return None, None, None, None
            return (*formula(backward, ctx, *grads)[:3], None)

    def differentiable(*inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return op(*inputs) if torch.compiler.is_compiling() else Eager.apply(*inputs[:3], inputs)

    return differentiable


_forward = _differentiable(attention_forward, _run_forward, attention_backward, _run_backward, _setup_context,
                           _backward)


# Eager training calls without ALiBi, dropout, a seed or mods: after a signature's first
# call, its forward launches what that call launched, and its backward reads the
# signatures of dout and dlse only (q, k, v, out and lse are the forward's). A step is
# kept in api's table, keyed with _Step among its scalars: what forgets api's warm calls
# (experiment.override) forgets the steps made of them.

class _Step:
    """A training call's signature: the ops' checked options after q, k and v (``args``),
    the forward's warm entry (``api._Warm``; None until it has run, and on the CPU), and
    the backward's entries by the signatures of dout and dlse (False without one)."""
    __slots__ = ("args", "forward", "backwards")

    def __init__(self, args: tuple):
        self.args, self.forward, self.backwards = args, None, {}


def _api_scalars(args: tuple, last) -> tuple:
    """api's warm-key scalars of the calls ``_run_forward`` and ``_run_backward`` make with
    a step's ``args`` (no seed, offset 0), ``last`` return_lse or deterministic."""
    causal, softmax_scale, _, left, right, softcap, _, dropout_p, _ = args
    return causal, softmax_scale, (left, right), softcap, dropout_p, None, 0, last


class _Steps(torch.autograd.Function):
    """attention's autograd for a ``_Step``: (out, lse) of q, k and v, and their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, step):
        ctx.set_materialize_grads(False)  # no zero gradient made for an unused lse
        if step.forward is None:
            out, lse, _ = _run_forward(q, k, v, *step.args, return_lse=True)
            step.forward = api._lookup(api._key((q, k, v), _api_scalars(step.args, True), None))
        else:
            out, lse = api._launch_warm(step.forward, q, k, v)
        ctx.step = step
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:  # out's and lse's gradients are undefined: so are the inputs'
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dout, dlse = _output_gradients(dout, dlse, out)
        step, signature = ctx.step, _arrays.signature
        key = signature(dout), dlse is not None and signature(dlse)
        given = (dout, q, k, v, out, lse) if dlse is None else (dout, q, k, v, out, lse, dlse)
        warm = step.backwards.get(key)
        if warm is not None:
            return (*api._backward_warm(warm, given), None)
        args = step.args
        grads = _run_backward(dout, q, k, v, out, lse, *args[:8], None, dlse)
        warm = api._lookup(api._key(given, _api_scalars(args, args[2]), None))
        if warm is not None and None not in key:  # (None: a type the call itself registered, no key before it)
            _warm.remember(step.backwards, key, warm)
        return (*grads, None)


# The same with score_mod / mask_mod: a custom op's schema has no default for a tensor
# list, so the mods get ops of their own whose last two inputs are the key and the tensors.

def _attention_mod_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           softmax_scale: Optional[float], deterministic: bool, window_left: int, window_right: int,
                           softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int],
                           mods: str, mod_tensors: list[torch.Tensor], block_statuses: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_forward with the score_mod / mask_mod registered under ``mods`` and, with
    ``block_statuses``, the int8 statuses of a block mask of that mask_mod."""
    out, lse, (seed, rng_offset) = _run_forward(q, k, v, causal, softmax_scale, deterministic, window_left,
                                                window_right, softcap, alibi_slopes, dropout_p, seed, mods,
                                                mod_tensors, block_statuses, return_lse=True)
    return out, lse, _rng_state(seed, rng_offset)


attention_mod_forward = torch.library.custom_op(
    "cuflash::attention_mod_forward", mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,))(_attention_mod_forward)


@attention_mod_forward.register_fake
def _attention_mod_forward_fake(q, k, v, causal, softmax_scale, deterministic, window_left, window_right, softcap,
                                alibi_slopes, dropout_p, seed, mods, mod_tensors, block_statuses=None):
    return _attention_forward_fake(q, k, v, causal, softmax_scale, deterministic)


def _attention_mod_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: Optional[float],
                            deterministic: bool, window_left: int, window_right: int, softcap: float,
                            alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng_state: Optional[torch.Tensor],
                            dlse: Optional[torch.Tensor], mods: str, mod_tensors: list[torch.Tensor],
                            block_statuses: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_backward with the score_mod / mask_mod registered under ``mods`` (and the
    forward's ``block_statuses``)."""
    return _run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, rng_state, dlse, mods, mod_tensors, block_statuses)


attention_mod_backward = torch.library.custom_op("cuflash::attention_mod_backward",
                                                 mutates_args=())(_attention_mod_backward)


@attention_mod_backward.register_fake
def _attention_mod_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left,
                                 window_right, softcap, alibi_slopes, dropout_p, rng_state, dlse, mods, mod_tensors,
                                 block_statuses=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_mod_forward = _differentiable(attention_mod_forward, _run_forward, attention_mod_backward, _run_backward,
                               _setup_context, _backward)


# --- packed variable length -------------------------------------------------------------------


def _attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                              softmax_scale: Optional[float], deterministic: bool, window_left: int = -1,
                              window_right: int = -1, softcap: float = 0.0,
                              alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                              seed: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, rng_state) of packed sequences; lse is float32 (nheads, total_q)."""
    out, lse, (seed, rng_offset) = _run_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
        window_left, window_right, softcap, alibi_slopes, dropout_p, seed, return_lse=True)
    return out, lse, _rng_state(seed, rng_offset)


def _run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                        deterministic, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, mods=None,
                        mod_tensors=(), block_statuses=None, *, return_lse: bool):
    """``_run_forward`` of packed sequences."""
    seed, rng_offset = _seed_and_offset(q, dropout_p, seed)
    options = _api_options(causal, softmax_scale, window_left, window_right, softcap, dropout_p, seed, rng_offset)
    if q.device.type != "cpu":
        arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    else:
        *arrays, alibi_slopes, block_statuses = _numpy(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                                       cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
                                                       block_mask=block_statuses)
        mod_tensors = _numpy_mod_tensors(mod_tensors)
    out, lse = api.attention_varlen(*arrays, max_seqlen_q, max_seqlen_k, alibi_slopes=alibi_slopes,
                                    return_lse=True, **options, **_mod_functions(mods, mod_tensors, block_statuses))
    if q.device.type == "cpu":
        out, lse = _tensor(out), _tensor(lse)
    return out, lse if return_lse else None, (seed, rng_offset)


attention_varlen_forward = torch.library.custom_op(
    "cuflash::attention_varlen_forward", mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,))(_attention_varlen_forward)


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
                                   alibi_slopes=None, dropout_p=0.0, seed=None):
    total_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32), _fake_rng_state())


def _attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               softmax_scale: Optional[float], deterministic: bool, window_left: int = -1,
                               window_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                               rng_state: Optional[torch.Tensor] = None, dlse: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention_varlen_forward's out and lse (dlse, or None)."""
    return _run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal, softmax_scale, deterministic, window_left, window_right, softcap,
                                alibi_slopes, dropout_p, rng_state, dlse)


def _run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, deterministic, window_left, window_right, softcap, alibi_slopes, dropout_p,
                         rng_state, dlse, mods=None, mod_tensors=(), block_statuses=None):
    seed, rng_offset = _from_rng_state(rng_state)
    options = _api_options(causal, softmax_scale, window_left, window_right, softcap, dropout_p, seed, rng_offset)
    if q.device.type != "cpu":
        return tuple(api.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                   max_seqlen_q, max_seqlen_k, alibi_slopes=alibi_slopes,
                                                   deterministic=deterministic, dlse=dlse, **options,
                                                   **_mod_functions(mods, mod_tensors, block_statuses)))
    *arrays, alibi_slopes, dlse, block_statuses = _numpy(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        alibi_slopes=alibi_slopes, dlse=dlse, block_mask=block_statuses)
    grads = api.attention_varlen_backward(*arrays, max_seqlen_q, max_seqlen_k, alibi_slopes=alibi_slopes,
                                          deterministic=deterministic, dlse=dlse, **options,
                                          **_mod_functions(mods, _numpy_mod_tensors(mod_tensors), block_statuses))
    return tuple(_tensor(g) for g in grads)


attention_varlen_backward = torch.library.custom_op(
    "cuflash::attention_varlen_backward", mutates_args=())(_attention_varlen_backward)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, deterministic, window_left=-1,
                                    window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                    rng_state=None, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal, ctx.softmax_scale,
     ctx.deterministic, ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, _,
     *mods) = inputs
    out, lse, rng_state = output
    ctx.mods = mods[0] if mods else None
    block_statuses = mods[2] if len(mods) > 2 else None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, block_statuses,
                          *(mods[1] if mods else ()))
    if rng_state is not None:  # (the eager call's, without dropout)
        ctx.mark_non_differentiable(rng_state)


def _varlen_backward(backward, ctx, dout, dlse, _drng_state):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, block_statuses,
     *mod_tensors) = ctx.saved_tensors
    dout, dlse = _output_gradients(dout, dlse, out)
    blocks = () if block_statuses is None else (block_statuses,)
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q,
                          ctx.max_seqlen_k, ctx.causal, ctx.softmax_scale, ctx.deterministic, ctx.window_left,
                          ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p, rng_state, dlse,
                          *_mod_inputs(ctx, mod_tensors), *blocks)
    return (dq, dk, dv) + (None,) * 13 + _mod_gradients(ctx, mod_tensors) + ((None,) if ctx.mods else ())


_varlen_forward = _differentiable(attention_varlen_forward, _run_varlen_forward, attention_varlen_backward,
                                  _run_varlen_backward, _setup_varlen_context, _varlen_backward)


def _attention_varlen_mod_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                  softmax_scale: Optional[float], deterministic: bool, window_left: int,
                                  window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                                  dropout_p: float, seed: Optional[int], mods: str, mod_tensors: list[torch.Tensor],
                                  block_statuses: Optional[torch.Tensor] = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_varlen_forward with the score_mod / mask_mod registered under ``mods`` (and,
    with ``block_statuses``, a block mask of that mask_mod)."""
    out, lse, (seed, rng_offset) = _run_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
        window_left, window_right, softcap, alibi_slopes, dropout_p, seed, mods, mod_tensors, block_statuses,
        return_lse=True)
    return out, lse, _rng_state(seed, rng_offset)


attention_varlen_mod_forward = torch.library.custom_op(
    "cuflash::attention_varlen_mod_forward", mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,))(_attention_varlen_mod_forward)


@attention_varlen_mod_forward.register_fake
def _attention_varlen_mod_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       softmax_scale, deterministic, window_left, window_right, softcap,
                                       alibi_slopes, dropout_p, seed, mods, mod_tensors, block_statuses=None):
    return _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                          softmax_scale, deterministic)


def _attention_varlen_mod_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                   softmax_scale: Optional[float], deterministic: bool, window_left: int,
                                   window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                                   dropout_p: float, rng_state: Optional[torch.Tensor], dlse: Optional[torch.Tensor],
                                   mods: str, mod_tensors: list[torch.Tensor],
                                   block_statuses: Optional[torch.Tensor] = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_varlen_backward with the score_mod / mask_mod registered under ``mods`` (and
    the forward's ``block_statuses``)."""
    return _run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal, softmax_scale, deterministic, window_left, window_right, softcap,
                                alibi_slopes, dropout_p, rng_state, dlse, mods, mod_tensors, block_statuses)


attention_varlen_mod_backward = torch.library.custom_op(
    "cuflash::attention_varlen_mod_backward", mutates_args=())(_attention_varlen_mod_backward)


@attention_varlen_mod_backward.register_fake
def _attention_varlen_mod_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, causal, softmax_scale, deterministic, window_left,
                                        window_right, softcap, alibi_slopes, dropout_p, rng_state, dlse, mods,
                                        mod_tensors, block_statuses=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_varlen_mod_forward = _differentiable(attention_varlen_mod_forward, _run_varlen_forward,
                                      attention_varlen_mod_backward, _run_varlen_backward, _setup_varlen_context,
                                      _varlen_backward)


# --- score_mod / mask_mod --------------------------------------------------------------------

# The traced functions of the calls so far, by key: a custom op takes no Python function,
# so the mod ops take the key (a string) and find the functions here. The key hashes the
# traced text and the tensors' shapes and dtypes: equal keys compute alike, and the first
# functions of a key stay for the life of the process.
_MODS: dict = {}


def _mod_tensor_names(mods: bool, mod_tensors) -> dict:
    """The mod tensors by the names the device checks give them."""
    if not mods or not isinstance(mod_tensors, (tuple, list)):
        return {}
    return {f"mod_tensors[{i}]": t for i, t in enumerate(mod_tensors)}


def _mod_arguments(score_mod, mask_mod, mod_tensors) -> tuple[str, list]:
    """The mod ops' last two inputs: the key of the traced functions, and the tensors
    (checked: torch tensors on q's device by now, none requiring grad)."""
    _options.check_mods(None, score_mod, mask_mod, mod_tensors)
    if torch.is_grad_enabled():
        for i, t in enumerate(mod_tensors):
            if t.requires_grad:
                raise ValueError(f"mod_tensors[{i}] requires grad, but cuflash gives mod tensors no gradient "
                                 f"(FlexAttention would give a captured tensor one): detach it, or call under "
                                 f"torch.no_grad()")
    specs = tuple((tuple(int(n) for n in t.shape), str(t.dtype).removeprefix("torch.")) for t in mod_tensors)
    return _register_mods(score_mod, mask_mod, specs), list(mod_tensors)


@torch.compiler.assume_constant_result  # (torch.compile calls it while tracing and keeps the key)
def _register_mods(score_mod, mask_mod, specs: tuple) -> str:
    """Trace the functions over tensors of these (shape, dtype)s and file them (and the mask's
    tree, for a block mask) under their key."""
    from .. import mod
    tensors = tuple(mod.TensorSpec(i, None, shape, dtype) for i, (shape, dtype) in enumerate(specs))
    trees = tuple(None if fn is None else mod.trace(fn, kind, tensors)
                  for fn, kind in ((score_mod, "score"), (mask_mod, "mask")))
    texts = tuple(None if tree is None else tree.text for tree in trees)
    key = hashlib.sha256(repr((texts, specs)).encode()).hexdigest()
    _MODS.setdefault(key, (score_mod, mask_mod, trees[1]))
    return key


def _mod_functions(mods: Optional[str], mod_tensors, block_statuses=None) -> dict:
    """``cuflash.attention``'s score_mod, mask_mod and mod_tensors for a registry key (none for
    None); with ``block_statuses`` (an array beside q), mask_mod and mod_tensors in a block mask
    of them, its shapes the call's (the statuses' shape is checked against the call's)."""
    if mods is None:
        return {}
    try:
        score_mod, mask_mod, mask_tree = _MODS[mods]
    except KeyError:
        raise ValueError(f"mods: no score_mod / mask_mod registered under {mods!r} in this process (the mod "
                         f"ops take the key cuflash.torch.attention made)") from None
    if block_statuses is None:
        return dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=tuple(mod_tensors))
    if mask_mod is None:
        raise ValueError(f"block_statuses: a block mask comes with its mask_mod, and the functions registered "
                         f"under {mods!r} have none")
    from ..mod import BlockMask
    return dict(score_mod=score_mod, block_mask=BlockMask(mask_mod, tuple(mod_tensors), mask_tree, block_statuses,
                                                          None, None, None, None))


def _block_mask_mods(block_mask, mask_mod, mod_tensors) -> tuple:
    """``_options.block_mask_mods``, the statuses a tensor (made with ``like=q``)."""
    mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    if not isinstance(block_mask.statuses, torch.Tensor):  # (a NumPy or CuPy one: its tensors are too)
        statuses = block_mask.statuses
        raise TypeError(f"block_mask's statuses must be a torch tensor on q's device, got "
                        f"{type(statuses).__module__}.{type(statuses).__qualname__}: make the block mask with "
                        f"cuflash.mod.create_block_mask(..., like=q)")
    return mask_mod, mod_tensors


def _block_statuses(block_mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed=None) -> torch.Tensor:
    """The statuses of a call's block mask (a tensor; ``_block_mask_mods`` passed), checked
    against the call before anything runs: on q's device, made for these shapes (``packed``:
    a packed call's (sequences, max_seqlen_q, max_seqlen_k))."""
    statuses = block_mask.statuses
    qi, ki, vi = (_describe(t) for t in (q, k, v))
    _options.check_qkv(qi, ki, vi, packed=packed is not None)
    batch, seqlen_q, seqlen_k = (q.shape[0], q.shape[1], k.shape[1]) if packed is None else packed
    _options.check_block_mask(block_mask, qi, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                              statuses=_describe(statuses))
    return statuses


def _numpy_mod_tensors(mod_tensors) -> tuple:
    if not mod_tensors:
        return ()
    return tuple(_numpy(**{f"mod_tensors[{i}]": t for i, t in enumerate(mod_tensors)}))


def _mod_inputs(ctx, mod_tensors: list) -> tuple:
    """The backward mod op's key and tensors (nothing for the plain ops)."""
    return () if ctx.mods is None else (ctx.mods, list(mod_tensors))


def _mod_gradients(ctx, mod_tensors: list) -> tuple:
    """No gradient for the key, one None per mod tensor (the formula mirrors the inputs' structure)."""
    return () if ctx.mods is None else (None, [None] * len(mod_tensors))


# --- the KV-cache call -----------------------------------------------------------------------


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *, cache_seqlens,
                           cache_batch_idx: Optional[torch.Tensor] = None,
                           cache_leftpad: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                           rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
                           rotary_interleaved: bool = True, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                           num_splits: int = 0, deterministic: bool = False, return_lse: bool = False):
    """``cuflash.attention_with_kvcache`` for torch tensors, through the custom op
    ``cuflash::attention_with_kvcache``, which declares k_cache and v_cache as written in
    place (torch.compile keeps the append; no gradient flows). An int ``cache_seqlens``
    becomes an int32 tensor on q's device."""
    if isinstance(q, torch.Tensor) and q.is_cuda and not torch.compiler.is_compiling():
        # Eager, or captured into a CUDA graph: the call itself (no gradient flows, and
        # there is no graph to tell of the writes), without the op's dispatch.
        return kvcache._attention_with_kvcache(
            (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
             rotary_sin, alibi_slopes), rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits,
            deterministic, return_lse)
    _options.check_bool("return_lse", return_lse)
    _options.check_bool("deterministic", deterministic)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) and isinstance(q, torch.Tensor):
        _options.check_integer("cache_seqlens", cache_seqlens, bits=31)
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    # The op's schema takes typed values: check them first (int(1.5) would hide a wrong one).
    _options.scalar_options(q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 1, 2**31, causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    _options.check_bool("rotary_interleaved", rotary_interleaved)
    _options.check_integer("num_splits", num_splits, bits=16)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                   rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors.values()):
        _refuse(tensors)
    left, right = window_size
    out, lse = kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                               rotary_cos, rotary_sin, rotary_interleaved, causal, softmax_scale, int(left),
                               int(right), float(softcap), alibi_slopes, int(num_splits), deterministic)
    return (out, lse) if return_lse else out


def _kvcache_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                     v: Optional[torch.Tensor], cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
                     cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                     rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], rotary_interleaved: bool,
                     causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
                     softcap: float, alibi_slopes: Optional[torch.Tensor], num_splits: int, deterministic: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the KV-cache call; k_cache and v_cache are written in place."""
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes)
    on_cpu = q.device.type == "cpu"
    if on_cpu:  # zero-copy NumPy views: the append writes the tensors' own storage
        arrays = dict(zip(arrays, _numpy(**arrays)))
    out, lse = kvcache.attention_with_kvcache(
        arrays.pop("q"), arrays.pop("k_cache"), arrays.pop("v_cache"), arrays.pop("k"), arrays.pop("v"), **arrays,
        rotary_interleaved=rotary_interleaved, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, softmax_scale=softmax_scale, num_splits=num_splits, deterministic=deterministic,
        return_lse=True)
    return (_tensor(out), _tensor(lse)) if on_cpu else (out, lse)


kvcache_forward = torch.library.custom_op("cuflash::attention_with_kvcache",
                                          mutates_args=("k_cache", "v_cache"))(_kvcache_forward)


@kvcache_forward.register_fake
def _kvcache_forward_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                          rotary_cos, rotary_sin, rotary_interleaved, causal, softmax_scale, window_left,
                          window_right, softcap, alibi_slopes, num_splits, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape[:3] + v_cache.shape[-1:]), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def merge_states(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuflash.merge_states`` for torch tensors (lists of parts, or tensors whose first
    dimension runs over the parts), on the CPU or a GPU, in torch's own operations, so
    that gradients flow through both outs and lses."""
    outs, lses = (list(x) if isinstance(x, (list, tuple)) else list(x.unbind(0)) if isinstance(x, torch.Tensor)
                  else x for x in (outs, lses))
    for name, parts in (("outs", outs), ("lses", lses)):
        if not isinstance(parts, list) or not parts:
            raise ValueError(f"{name} must hold at least one part")
        if not all(isinstance(t, torch.Tensor) for t in parts):
            raise TypeError(f"{name} must hold torch tensors")
    _options.check_merge([_describe(t) for t in outs], [_describe(t) for t in lses])
    outs, lses = torch.stack(outs), torch.stack(lses)
    acc = torch.float64 if outs.dtype == torch.float64 else torch.float32
    lses = lses.to(acc)
    empty = torch.isinf(lses)
    finite = torch.where(empty, -math.inf, lses)
    top = finite.amax(0)
    seen = torch.isfinite(top)
    weights = torch.where(empty, 0.0, torch.exp(finite - torch.where(seen, top, 0.0)))  # no -inf - -inf
    total = weights.sum(0)
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)), math.inf).float()
    share = (weights / torch.where(seen, total, 1.0)).permute(0, 1, 3, 2).unsqueeze(-1)  # (parts, b, s, h, 1)
    return (share * outs.to(acc)).sum(0).to(outs.dtype), lse


def _describe(t: torch.Tensor):
    """A tensor, CPU or CUDA, as the shared checks see it."""
    from .._arrays import ArrayInfo
    return ArrayInfo(t, "torch", 0, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                     None if t.device.type == "cpu" else t.device.index)


# --- helpers ---------------------------------------------------------------------------------


def _api_options(causal, softmax_scale, window_left, window_right, softcap, dropout_p, seed, rng_offset) -> dict:
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                softcap=softcap, dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)


def _seed_and_offset(q: torch.Tensor, dropout_p: float, seed: Optional[int]) -> tuple[Optional[int], int]:
    """The forward's (seed, rng_offset): the caller's seed with offset 0, else a draw from
    torch's default generator of q's device. Without dropout there is nothing to draw."""
    if seed is not None:
        return int(seed) % _UINT64, 0
    if not dropout_p > 0:
        return None, 0
    if q.device.type == "cuda":
        generator = torch.cuda.default_generators[q.device.index if q.device.index is not None
                                                  else torch.cuda.current_device()]
        offset = generator.get_offset()
        # CUDA generators count Philox offsets in steps of 4 (set_offset insists on it).
        generator.set_offset(offset + 4)
        return generator.initial_seed() % _UINT64, offset // 4
    # The CPU generator has no Philox offset: draw a whole seed from it instead.
    return int(torch.randint(2**63 - 1, (), dtype=torch.int64)), 0


def _int64(seed: Optional[int]) -> Optional[int]:
    """A seed in [0, 2**64) as the signed 64-bit int an op's schema can carry (the ops take
    it back modulo 2**64)."""
    if seed is None:
        return None
    seed = int(seed) % _UINT64
    return seed - _UINT64 if seed >= 2**63 else seed


def _rng_state(seed: Optional[int], rng_offset: int) -> torch.Tensor:
    """[seed, rng_offset] as int64 on the CPU; the seed wraps to a signed 64-bit value."""
    if seed is None and rng_offset == 0:  # no dropout: zeros cost a third of a tensor from a list
        return torch.zeros(2, dtype=torch.int64)
    return torch.tensor([_int64(seed) or 0, rng_offset], dtype=torch.int64)


def _from_rng_state(rng_state: Optional[torch.Tensor]) -> tuple[Optional[int], int]:
    if rng_state is None:
        return None, 0
    seed, rng_offset = rng_state.tolist()
    return seed % _UINT64, rng_offset


def _fake_rng_state() -> torch.Tensor:
    return torch.empty(2, dtype=torch.int64, device="cpu")


def _output_gradients(dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor],
                      out: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The backward ops' dout and dlse from the gradients autograd hands the formula: a
    zero dout where only lse is used; dlse stays None where lse is unused."""
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # e.g. the expanded gradient of out.sum(): the kernel needs a unit-stride last dim
        dout = dout.contiguous()
    # lse's layout contract (e.g. lse.sum() sends an expanded gradient)
    return dout, None if dlse is None else dlse.contiguous()


def _numpy(**tensors) -> list:
    """Zero-copy NumPy views of CPU tensors (None stays None), with the errors a caller can act on."""
    present = {name: t for name, t in tensors.items() if t is not None}
    where = {name: str(t.device) for name, t in present.items()}
    if set(where.values()) != {"cpu"}:
        raise ValueError(f"tensors must be on one device, got {where}")
    for name, t in present.items():
        if t.dtype == torch.bfloat16:
            raise TypeError(f"{name} is a bfloat16 CPU tensor; the CPU path runs on NumPy, which has no "
                            f"bfloat16: use float16/float32/float64 on the CPU, or a CUDA tensor")
    return [None if t is None else t.detach().numpy() for t in tensors.values()]


def _tensor(x: np.ndarray) -> torch.Tensor:
    # Contiguous, as the fake implementations promise.
    return torch.from_numpy(np.ascontiguousarray(x))

