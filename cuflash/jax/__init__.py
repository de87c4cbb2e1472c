"""JAX glue: differentiable attention that works eagerly and under jax.jit, zero-copy.

    import cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)
    grads = jax.jit(jax.grad(lambda q, k, v: cuflash.jax.attention(q, k, v).sum(), (0, 1, 2)))(q, k, v)
    out, lse = cuflash.jax.attention(q, k, v, return_lse=True)   # both differentiable

The forward and the backward are each one ``jax.experimental.buffer_callback``: XLA
allocates the outputs (and the backward's scratch buffers), hands the callback its device
buffers and its stream, and the kernels read and write those buffers in place on that
stream. Nothing is copied and nothing synchronises (but see traced dropout seeds below).
``jax.custom_vjp`` ties the two together, so jax.grad, jax.jit and jax.vmap (one call per
mapped element) all apply. ``attention_varlen`` does the same for packed sequences.

The custom_vjp's output is always (out, lse), so gradients flow through lse as well as out
(lse float32 (batch, nheads, seqlen_q), or (nheads, total_q) packed; +inf for a row that
sees no key, whose gradient is ignored). ``return_lse=False`` drops lse after it; its
cotangent then arrives as zeros, which the backward adds at the cost of one float a row.

The options are flash-attn's (see ``cuflash.attention``). ``alibi_slopes`` is an array
input (float32 (nheads,) or (batch, nheads)) that gets a zero cotangent. Dropout needs a
``seed``, as JAX has no global random state:

- a Python int: static, part of the compiled computation (under jit, a new int compiles
  again), read by the kernel with no synchronisation;
- an integer array (traced or not) of at most 64 bits: a scalar, or two uint32 words
  [low, high] such as ``jax.random.bits(key, (2,), jnp.uint32)``, or a typed PRNG key
  (its key data, e.g. [0, n] for ``jax.random.key(n)``). The seed is then an input of the
  callback: on a GPU the callback copies its 8 bytes to the host before launching, which
  waits for XLA's stream up to that point.

Either way the mask is ``cuflash._philox``'s for (seed, rng_offset 0), and the backward
regenerates it from the same seed. Under vmap every mapped element gets the same seed, so
the same mask.

Programmable attention (``score_mod``, ``mask_mod``, ``mod_tensors``; ``cuflash.mod``): the
functions are traced while tracing and are static, part of the configuration, equal by
their traced text and the tensors' shapes and dtypes (two function objects of one text
share an executable); the mod tensors are inputs of the callbacks with zero cotangents
(jax.grad with respect to one gives zeros: cuflash gives mod tensors no gradient yet). A
block mask (``block_mask``) is a pytree: its statuses are one more input (and
its mod tensors the mod tensors), its mask_mod and sizes static, so a jitted function that
takes one runs another of the same shapes and mask_mod with the same executable.

Arrays on the CPU take the same route: buffer_callback gives host buffers there, and the
callback runs the NumPy path on them (float16, float32, float64). One route for both means
jit needs no platform switch and the glue is testable without a GPU.

Inputs are checked while tracing, where an array under jit has no device yet: the checks
that differ between CPU and GPU (the dtypes) assume the default device, as jit does for
uncommitted arrays. Under ``with jax.default_device(cpu)`` they follow the CPU rules.
The values of cu_seqlens are checked when they are concrete (eagerly); under jit on a GPU
they go to the kernel unchecked, as flash-attn's do.

Needs JAX with ``jax.experimental.buffer_callback`` (0.7 or newer). Importing this package
imports jax; ``import cuflash`` alone does not.
"""
from .calls import attention, attention_varlen, attention_with_kvcache, merge_states
from .ring import ring_attention

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "merge_states", "ring_attention"]
