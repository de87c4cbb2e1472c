"""PyTorch glue: autograd, torch.compile and CUDA graphs through torch.library custom ops.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)   # differentiable
    out.sum().backward()
    out, lse = cuflash.torch.attention(q, k, v, return_lse=True)   # both differentiable

Four custom ops carry the work: ``cuflash::attention_forward`` -> (out, lse, rng_state),
``cuflash::attention_backward`` -> (dq, dk, dv), and their packed variable-length twins
``cuflash::attention_varlen_forward`` / ``cuflash::attention_varlen_backward``. Each has a
fake (meta) implementation, so torch.compile traces them as opaque nodes with no graph
break, and the forwards have an autograd formula that calls the backward op. Gradients
flow through out and lse (float32 (batch, nheads, seqlen_q), or (nheads, total_q)
packed; +inf for a row that sees no key, whose gradient is ignored): the backward ops
take lse's gradient as an optional ``dlse`` and skip it when None (lse unused). A custom op
(unlike an autograd.Function calling CuPy) is what keeps ``torch.compile(fullgraph=True)``
whole. Eager calls of ``attention`` / ``attention_varlen`` (and ``flash_attn_interface``)
run the same functions and formulas through an autograd.Function instead: the ops' eager
dispatch checks every output against every input for aliasing, ~500 us a training step. A
dense eager training call without ALiBi, dropout, a seed or mods whose signature has run
checks nothing: its forward launches what the first call launched, and its backward reads
the signatures of dout and dlse only (q, k, v, out and lse are the forward's).

Programmable attention (``score_mod``, ``mask_mod``, ``mod_tensors``; ``cuflash.mod``)
takes four more ops, ``cuflash::attention_mod_forward`` / ``attention_mod_backward`` and
their varlen twins, with two more inputs, each required (a schema gives a tensor list no
default): ``mods``, a string, and ``mod_tensors``, a list of tensors without gradient (one
that requires grad is refused: FlexAttention would give it a gradient, cuflash does not).
A custom op takes no Python function, so the functions are traced and filed in a registry
of the process under the hash of their traced text and the tensors' shapes and dtypes,
and ``mods`` is that key; under torch.compile the key is made while tracing
(``torch.compiler.assume_constant_result``), a constant of the graph, so
``fullgraph=True`` holds. A block mask (``block_mask``; made with
``cuflash.mod.create_block_mask(..., like=q)``) gives the mod ops one more input,
``block_statuses``, its int8 statuses: data beside the mod tensors, not part of the key,
so a compiled graph takes another block mask of the same shapes without recompiling.

The options are flash-attn's (see ``cuflash.attention``): ``window_size``, ``softcap``,
``alibi_slopes`` (a float32 tensor on q's device; an input of the ops that gets no
gradient) and ``dropout_p``. The ops take them as plain values (window_left and
window_right ints, floats, an optional tensor, the seed a signed 64-bit int: seeds of
2**63 and up as their two's complement) because a custom op's schema needs concrete
types.

Dropout seeds. With ``seed=None`` the forward op draws (seed, rng_offset) when it runs,
from torch's default generator of q's device: for CUDA, that generator's seed and its
Philox offset, which the op advances (by 4, as torch's own random ops do), so
``torch.manual_seed`` reproduces a run and consecutive calls get different masks. The pair
comes back as ``rng_state``, an int64 CPU tensor [seed, rng_offset] (the seed as a signed
64-bit value), which autograd saves for the backward: the backward regenerates the
forward's exact mask without a device sync. An explicit ``seed`` gives rng_offset 0. The
op is tagged ``nondeterministic_seeded`` so that compilers neither merge two calls nor
recompute one in the backward. Under CUDA-graph capture the seed is drawn once, at
capture: every replay reuses that mask (pass dropout_p=0, or capture per step, where that
matters).

CUDA tensors run the kernels on torch's current stream, outputs from torch's caching
allocator, so CUDA-graph capture works once the kernel variant has been compiled (the
first call compiles with NVRTC, which must not happen during capture).

CPU tensors run the NumPy path through zero-copy NumPy views (float16, float32, float64).
NumPy has no bfloat16, so bfloat16 CPU tensors raise TypeError. The CPU path exists to
make the glue testable without a GPU; it is not fast.

Importing this package imports torch; ``import cuflash`` alone does not.
"""
from .calls import (attention, attention_backward, attention_forward, attention_mod_backward,
                    attention_mod_forward, attention_varlen, attention_varlen_backward, attention_varlen_forward,
                    attention_varlen_mod_backward, attention_varlen_mod_forward, attention_with_kvcache,
                    merge_states)
from .ring import ring_attention

__all__ = ["attention", "attention_varlen", "attention_forward", "attention_backward",
           "attention_varlen_forward", "attention_varlen_backward", "attention_mod_forward", "attention_mod_backward",
           "attention_varlen_mod_forward", "attention_varlen_mod_backward", "attention_with_kvcache", "merge_states",
           "ring_attention"]
