"""JAX's calls: the forward and backward buffer callbacks, the custom_vjp that ties them,
and the functions ``cuflash.jax`` exports (its docstring tells how they fit).

Importing this module imports jax; ``import cuflash`` alone does not.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .. import _arrays, _device, _kernels, _options, _plan, api, kvcache, mod

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # older JAX: attention() says what to upgrade to
    buffer_callback = None

_DLPACK_CPU = 1  # kDLCPU in DLPack's DLDeviceType


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, *, deterministic: bool = False,
              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, seed=None,
              return_lse: bool = False, score_mod=None, mask_mod=None, mod_tensors=(), block_mask=None):
    """Differentiable ``cuflash.attention`` for JAX arrays: returns out, or (out, lse) with
    ``return_lse`` (lse float32 (batch, nheads, seqlen_q), differentiable too).

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim);
    see ``cuflash.attention`` for the semantics of the options and ``cuflash.jax`` for
    seeds. float16/bfloat16 on a GPU, float16/float32/float64 on the CPU. ``deterministic``
    makes the backward bitwise reproducible. ``score_mod``, ``mask_mod`` and ``mod_tensors``
    as ``cuflash.attention`` (see ``cuflash.jax``: the functions are static, the tensors
    inputs without gradient). ``block_mask``: a ``cuflash.mod.BlockMask`` made for these
    shapes, which carries mask_mod and mod_tensors, as ``cuflash.attention`` (see
    ``cuflash.jax``: a pytree whose statuses and mod tensors are inputs).
    """
    config, extras = _prepare(q, k, v, None, causal, softmax_scale, deterministic, window_size, softcap,
                              alibi_slopes, dropout_p, seed, score_mod, mask_mod, mod_tensors, block_mask)
    out, lse = _attention(q, k, v, extras, config)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, softmax_scale: float | None = None, *, deterministic: bool = False,
                     window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                     seed=None, return_lse: bool = False, block_table=None, score_mod=None, mask_mod=None,
                     mod_tensors=(), block_mask=None):
    """Differentiable ``cuflash.attention_varlen`` for JAX arrays: returns out, or (out, lse)
    with ``return_lse`` (lse float32 (nheads, total_q), differentiable too).

    q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim) packed; sequence
    b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v (int32 (batch + 1,) arrays); max_seqlen_q/k (Python ints, static) bound
    the lengths. Options as ``attention`` (score_mod and mask_mod see b, the sequence
    index; a block mask is made over (sequences, heads, max_seqlen_q, max_seqlen_k)). With
    ``block_table``, k and v are page pools (``cuflash.attention_varlen``):
    forward only, no dropout, no score_mod or mask_mod.
    """
    if block_table is not None:
        if _options.has_mods(score_mod, mask_mod, mod_tensors):
            raise NotImplementedError("score_mod and mask_mod do not take block_table (the paged call) yet")
        if dropout_p != 0:
            raise ValueError(f"dropout_p must be 0 with block_table (the paged call is for inference), got {dropout_p}")
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                             softmax_scale, window_size, softcap, alibi_slopes, return_lse)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    config, extras = _prepare(q, k, v, varlen, causal, softmax_scale, deterministic, window_size, softcap,
                              alibi_slopes, dropout_p, seed, score_mod, mask_mod, mod_tensors, block_mask)
    out, lse = _attention(q, k, v, extras, config)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved: bool = True, causal: bool = False, window_size=(-1, -1),
                           softcap: float = 0.0, alibi_slopes=None, softmax_scale: float | None = None,
                           num_splits: int = 0, deterministic: bool = False, return_lse: bool = False):
    """Functional ``cuflash.attention_with_kvcache`` for JAX arrays: returns (out, k_cache,
    v_cache), the caches with the new keys and values appended, or (out, lse, k_cache,
    v_cache) with ``return_lse``. The returned caches alias the given ones: under jax.jit
    with k_cache and v_cache donated (``donate_argnums``) the append writes them in place.
    Lengths and indices are checked while tracing when they are concrete. No gradient.
    """
    if buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or newer); "
                          f"this is JAX {jax.__version__}: pip install -U jax")
    _options.check_bool("return_lse", return_lse)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        _options.check_integer("cache_seqlens", cache_seqlens, bits=31)
        cache_seqlens = jnp.full((q.shape[0],), cache_seqlens, jnp.int32)
    optional = {name: jnp.asarray(x) for name, x in (
        ("k", k), ("v", v), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad), ("block_table", block_table), ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin)) if x is not None}
    described = {name: _describe(x, q) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                        *optional.items())}
    cache = _options.kvcache({n: described[n] for n in ("q", "k_cache", "v_cache", "k", "v") if n in described},
                             described.get("cache_seqlens"), described.get("cache_batch_idx"),
                             described.get("cache_leftpad"), described.get("block_table"),
                             described.get("rotary_cos"), described.get("rotary_sin"), rotary_interleaved, causal,
                             window_size, num_splits, deterministic)
    options = _options.scalar_options(q.shape[-1], cache.capacity, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap)
    if alibi_slopes is not None:
        optional["alibi_slopes"] = _check_alibi(alibi_slopes, q.shape[-2], q.shape[0])
    config = _KVCacheConfig(**_DecodeConfig.of(q, options, cache), rotary_interleaved=bool(rotary_interleaved),
                            rotary_dtype=None if cache.rotary_cos is None else cache.rotary_cos.dtype,
                            num_splits=cache.num_splits, deterministic=cache.deterministic, inputs=tuple(optional))
    results = (jax.ShapeDtypeStruct(q.shape[:3] + v_cache.shape[-1:], q.dtype),
               jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32),
               jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    workspace = {}
    if _platform(q) != "cpu":  # the split kernel's partial results: shapes from the plan
        # (planned without thread block clusters, which need none: the launch may merge
        # in the merge kernel, _kernels.decode_launcher)
        gpu_options = options._replace(alibi=None if alibi_slopes is None else _describe(optional["alibi_slopes"], q))
        plan = _plan.decode(*(described.get(n) for n in ("q", "k_cache", "v_cache", "k", "v")), described["q"],
                            cache, gpu_options, _device.facts(0)._replace(clusters=False))
        workspace = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in plan.workspace}
    call = buffer_callback(_KVCacheCallback(config), (*results, workspace), input_output_aliases={1: 2, 2: 3},
                           vmap_method="sequential")
    out, lse, k_cache, v_cache, _ = call(q, k_cache, v_cache, *optional.values())
    return (out, lse, k_cache, v_cache) if return_lse else (out, k_cache, v_cache)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                  softmax_scale, window_size, softcap, alibi_slopes, return_lse):
    """The varlen call over a paged cache: one buffer_callback, forward only (it has no
    differentiation rule: jax.grad through it fails)."""
    if buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or newer); "
                          f"this is JAX {jax.__version__}: pip install -U jax")
    _options.check_bool("return_lse", return_lse)
    inputs = {name: jnp.asarray(x) for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                                                    ("block_table", block_table))}
    described = {name: _describe(x, q) for name, x in (("q", q), ("k", k), ("v", v), *inputs.items())}
    varlen, cache = _options.paged_varlen(described["q"], described["k"], described["v"],
                                          described["cu_seqlens_q"], described["cu_seqlens_k"], max_seqlen_q,
                                          max_seqlen_k, described["block_table"])
    options = _options.scalar_options(q.shape[-1], varlen.max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap)
    if alibi_slopes is not None:
        inputs["alibi_slopes"] = _check_alibi(alibi_slopes, q.shape[-2], varlen.batch)
    config = _PagedVarlenConfig(**_DecodeConfig.of(q, options, cache),
                                max_seqlens=(varlen.max_seqlen_q, varlen.max_seqlen_k), inputs=tuple(inputs))
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
    workspace = {}
    if _platform(q) != "cpu":
        gpu_options = options._replace(alibi=None if alibi_slopes is None else _describe(inputs["alibi_slopes"], q))
        plan = _plan.decode(described["q"], described["k"], described["v"], None, None, described["q"], cache,
                            gpu_options, _device.facts(0)._replace(clusters=False), varlen)
        workspace = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in plan.workspace}
    call = buffer_callback(_PagedVarlenCallback(config), (*results, workspace), vmap_method="sequential")
    out, lse, _ = call(q, k, v, *inputs.values())
    return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class _DecodeConfig:
    """The static part of a call of the decode kernel (hashable: eager calls reuse their
    executable): the attention options and the cache's page size and capacity."""
    dtype: str
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    page_size: int
    capacity: int

    @staticmethod
    def of(q, options: _options.Options, cache: _options.KVCache) -> dict:
        return dict(dtype=np.dtype(q.dtype).name, causal=options.causal, scale=options.scale, window=options.window,
                    softcap=options.softcap, page_size=cache.page_size, capacity=cache.capacity)


@dataclasses.dataclass(frozen=True)
class _PagedVarlenConfig(_DecodeConfig):
    """The static part of a paged varlen call."""
    max_seqlens: tuple[int, int]
    inputs: tuple[str, ...]  # names of the callback's inputs after q, k, v


@dataclasses.dataclass(frozen=True)
class _PagedVarlenCallback:
    config: _PagedVarlenConfig

    def __call__(self, ctx, outputs, q, k, v, *inputs):
        out, lse, workspace = outputs
        c = self.config
        inputs = dict(zip(c.inputs, inputs))
        if _on_cpu(q):
            host = {name: np.asarray(b) for name, b in inputs.items()}
            results = kvcache.attention_varlen_paged(
                np.asarray(q), np.asarray(k), np.asarray(v), host["cu_seqlens_q"], host["cu_seqlens_k"],
                *c.max_seqlens, host["block_table"], causal=c.causal, softmax_scale=c.scale, window_size=c.window,
                softcap=c.softcap, alibi_slopes=host.get("alibi_slopes"), return_lse=True)
            return _write((out, lse), results)
        described = {name: _info(b, "float32" if name == "alibi_slopes" else "int32") for name, b in inputs.items()}
        arrays = {"q": _info(q, c.dtype), "k_cache": _info(k, c.dtype), "v_cache": _info(v, c.dtype)}
        cache = _options.KVCache(0, None, None, None, described["block_table"], c.page_size, c.capacity, 0, None,
                                 None, True, 0)
        varlen = _options.Varlen(described["cu_seqlens_q"], described["cu_seqlens_k"], *c.max_seqlens)
        options = _options.Options(c.causal, c.scale, c.window, c.softcap, described.get("alibi_slopes"))
        _launch_decode(ctx, {**described, **arrays}, _info(out, c.dtype), _info(lse, "float32"), workspace, cache,
                       options, varlen)


def merge_states(outs, lses):
    """``cuflash.merge_states`` for JAX arrays (lists of parts, or arrays whose first axis
    runs over the parts), in jax.numpy: on any device, under jit, differentiable."""
    outs, lses = (list(x) if isinstance(x, (list, tuple)) else list(jnp.asarray(x)) for x in (outs, lses))
    for name, parts in (("outs", outs), ("lses", lses)):
        if not parts:
            raise ValueError(f"{name} must hold at least one part")
    outs, lses = [jnp.asarray(x) for x in outs], [jnp.asarray(x) for x in lses]
    _options.check_merge([_describe(x, outs[0]) for x in outs], [_describe(x, outs[0]) for x in lses])
    return kvcache.merge_stacked(jnp.stack(outs), jnp.stack(lses), jnp)


@dataclasses.dataclass(frozen=True)
class _KVCacheConfig(_DecodeConfig):
    """The static part of a KV-cache call."""
    rotary_interleaved: bool
    rotary_dtype: str | None
    num_splits: int
    deterministic: bool
    inputs: tuple[str, ...]  # names of the callback's inputs after q, k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class _KVCacheCallback:
    config: _KVCacheConfig

    def __call__(self, ctx, outputs, q, k_cache, v_cache, *inputs):
        # k_cache and v_cache alias their outputs: the append writes the output buffers,
        # which hold the caches' contents.
        out, lse, k_out, v_out, workspace = outputs
        c = self.config
        if not _on_cpu(q):
            return self._gpu(ctx, out, lse, k_out, v_out, workspace, q, dict(zip(c.inputs, inputs)))
        host = {name: np.asarray(b) for name, b in zip(self.config.inputs, inputs)}
        results = kvcache.attention_with_kvcache(
            np.asarray(q), np.asarray(k_out), np.asarray(v_out), host.pop("k", None), host.pop("v", None), **host,
            rotary_interleaved=c.rotary_interleaved, causal=c.causal, window_size=c.window, softcap=c.softcap,
            softmax_scale=c.scale, num_splits=c.num_splits, deterministic=c.deterministic, return_lse=True)
        _write((out, lse), results)

    def _gpu(self, ctx, out, lse, k_cache, v_cache, workspace: dict, q, inputs: dict) -> None:
        c = self.config
        dtypes = dict(cache_seqlens="int32", cache_batch_idx="int32", cache_leftpad="int32", block_table="int32",
                      rotary_cos=c.rotary_dtype, rotary_sin=c.rotary_dtype, alibi_slopes="float32")
        described = {name: _info(b, dtypes.get(name, c.dtype)) for name, b in inputs.items()}
        arrays = {"q": _info(q, c.dtype), "k_cache": _info(k_cache, c.dtype), "v_cache": _info(v_cache, c.dtype),
                  **{n: described[n] for n in ("k", "v") if n in described}}
        cache = _options.KVCache(described["cache_seqlens"], None, described.get("cache_batch_idx"),
                                 described.get("cache_leftpad"), described.get("block_table"), c.page_size,
                                 c.capacity, arrays["k"].shape[1] if "k" in arrays else 0,
                                 described.get("rotary_cos"), described.get("rotary_sin"), c.rotary_interleaved,
                                 c.num_splits, c.deterministic)
        options = _options.Options(c.causal, c.scale, c.window, c.softcap, described.get("alibi_slopes"))
        _launch_decode(ctx, {**described, **arrays}, _info(out, c.dtype), _info(lse, "float32"), workspace, cache,
                       options)


def _launch_decode(ctx, infos: dict, out: _arrays.ArrayInfo, lse: _arrays.ArrayInfo, workspace: dict,
                   cache: _options.KVCache, options: _options.Options, varlen: _options.Varlen | None = None) -> None:
    """The split kernel (and its merge) on XLA's buffers: ``infos`` by argument name, the
    splits' workspace as the plan declared it."""
    arrays = {name: infos[name] for name in ("q", "k_cache", "v_cache", "k", "v") if name in infos}
    launcher = _kernels.decode_launcher(arrays, out, cache, options, varlen)
    work = [_info(workspace[name], "float32").ptr if name in workspace else 0 for name in ("partial_o", "partial_lse")]
    launcher(ctx.stream, *_kernels.decode_pointers({name: a.ptr for name, a in infos.items()}, out.ptr, lse.ptr,
                                                   *work))


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about a call: hashable by value, so that JAX caches the compiled
    executable of an eager call on it instead of compiling again."""
    dtype: str  # of q, k, v, out and the gradients; lse and the workspace are float32
    causal: bool
    scale: float
    window: tuple[int, int]  # normalised: -1 unbounded, causal folded in
    softcap: float
    dropout_p: float
    seed: int | None  # a static seed; None: no dropout, or the seed is the "seed" input
    deterministic: bool
    max_seqlens: tuple[int, int] | None  # (max_seqlen_q, max_seqlen_k) of a packed batch
    inputs: tuple[str, ...]  # names of the callback's inputs after q, k, v (the extras')
    mods: _Mods | None = None  # score_mod / mask_mod; their tensors are inputs "mod_tensors[i]"

    @property
    def varlen(self) -> bool:
        return self.max_seqlens is not None

    @property
    def extras(self) -> bool:  # as _options.Options.extras
        return self.softcap > 0 or self.dropout_p > 0 or "alibi_slopes" in self.inputs or self.mods is not None


@dataclasses.dataclass(frozen=True)
class _Mods:
    """score_mod and mask_mod of a call, static: equal (and hashing alike) by their traced
    text and the tensors' shapes and dtypes, so that jit and eager calls reuse an executable
    whatever function object wrote them."""
    texts: tuple[str | None, str | None]  # the traced trees' canonical texts (cuflash.mod.Traced.text)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # (the buffers of bfloat16 tensors describe themselves as '<V2')
    blocks: bool = False  # a block mask's statuses are the input "block_mask"
    # The CUDA text (cuflash.mod.kernel_source; its comments name the function, so it does
    # not take part in equality) and the functions and the mask's tree, for the NumPy path.
    source: str = dataclasses.field(default="", compare=False)
    score_mod: object = dataclasses.field(default=None, compare=False)
    mask_mod: object = dataclasses.field(default=None, compare=False)
    mask_tree: object = dataclasses.field(default=None, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"mod_tensors[{i}]" for i in range(len(self.dtypes)))


def _prepare(q, k, v, varlen, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes,
             dropout_p, seed, score_mod=None, mask_mod=None, mod_tensors=(), block_mask=None):
    """Check everything that exists while tracing (shapes, dtypes, option values), so that
    user errors are raised here, not from inside a callback. Returns the static _Config
    and the array inputs beside q, k, v (a dict: alibi, seed, cu_seqlens_q/k, mod tensors,
    a block mask's statuses)."""
    if buffer_callback is None:
        raise ImportError(f"cuflash.jax needs jax.experimental.buffer_callback (JAX 0.7 or newer); "
                          f"this is JAX {jax.__version__}: pip install -U jax")
    if block_mask is not None:
        mask_mod, mod_tensors = _options.block_mask_mods(block_mask, mask_mod, mod_tensors)
    infos = [_describe(x, q) for x in (q, k, v)]
    _options.check_qkv(*infos, packed=varlen is not None)
    _options.check_bool("deterministic", deterministic)
    extras = {}
    if varlen is None:
        batch, seqlen_k, max_seqlens = q.shape[0], k.shape[1], None
    else:
        extras["cu_seqlens_q"], extras["cu_seqlens_k"] = _check_cu_seqlens(q, k, *varlen)
        max_seqlens = tuple(int(n) for n in varlen[2:])
        batch, seqlen_k = extras["cu_seqlens_q"].shape[0] - 1, max_seqlens[1]
    if alibi_slopes is not None:
        extras["alibi_slopes"] = _check_alibi(alibi_slopes, q.shape[-2], batch)
    # A Python int seed is static; an array seed is an input of the callback.
    static_seed = seed if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) else None
    options = _options.scalar_options(q.shape[-1], seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                                      seed=static_seed)
    if options.dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs a seed: JAX has no global random state. Pass an int, or an "
                         "integer array such as jax.random.bits(key, (2,), jnp.uint32)")
    if seed is not None and static_seed is None:
        words = _seed_words(seed)  # checked even without dropout, where it is not used
        if options.dropout_p > 0:
            extras["seed"] = words
    mods = None
    if _options.has_mods(score_mod, mask_mod, mod_tensors):
        seqlen_q = q.shape[1] if varlen is None else max_seqlens[0]
        mods, tensors = _trace_mods(q, score_mod, mask_mod, mod_tensors, batch, seqlen_q, seqlen_k,
                                    block_mask is not None)
        extras.update(zip(mods.names, tensors))
        if block_mask is not None:
            extras["block_mask"] = _block_statuses(block_mask, q, batch, seqlen_q, seqlen_k)
    config = _Config(np.dtype(q.dtype).name, options.causal, options.scale, options.window, options.softcap,
                     options.dropout_p, options.seed if options.dropout_p > 0 and static_seed is not None else None,
                     bool(deterministic), max_seqlens, tuple(extras), mods)
    return config, extras


def _trace_mods(q, score_mod, mask_mod, mod_tensors, batch: int, seqlen_q: int, seqlen_k: int,
                blocks: bool = False):
    """The static _Mods of a call (``blocks``: with a block mask) and its mod tensors as
    arrays. The functions are traced over the tensors' shapes and dtypes, and their indices
    checked over the call's positions here, while tracing: on a GPU by the kernels' rules
    (``_options.device_mods``), on the CPU as the NumPy path would find them."""
    qi = _describe(q, q)
    _options.check_mods(qi, score_mod, mask_mod, mod_tensors)
    tensors = [jnp.asarray(t) for t in mod_tensors]
    infos = tuple(_describe(t, q) for t in tensors)
    if _platform(q) != "cpu":  # (the kernels' limits on the tensors, and the index checks)
        _options.device_mods(qi, score_mod, mask_mod, infos, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    specs = tuple(mod.TensorSpec(i, None, a.shape, a.dtype) for i, a in enumerate(infos))
    trees = [None if fn is None else mod.trace(fn, kind, specs) for fn, kind in ((score_mod, "score"),
                                                                                  (mask_mod, "mask"))]
    if batch and q.shape[-2] and seqlen_q and seqlen_k:
        domain = {"b": (0, batch - 1), "h": (0, q.shape[-2] - 1), "q_idx": (0, seqlen_q - 1),
                  "kv_idx": (0, seqlen_k - 1)}
        for tree in trees:
            if tree is not None:
                mod.index_ranges(tree, domain)
    mods = _Mods(tuple(None if tree is None else tree.text for tree in trees), tuple(a.shape for a in infos),
                 tuple(a.dtype for a in infos), blocks, mod.kernel_source(*trees, blocks), score_mod, mask_mod,
                 trees[1])
    return mods, tensors


def _block_statuses(block_mask, q, batch: int, seqlen_q: int, seqlen_k: int):
    """The statuses of a call's block mask (``_options.block_mask_mods`` passed) as an
    array input, checked against the call's shapes while tracing."""
    statuses = block_mask.statuses
    if not isinstance(statuses, (np.ndarray, jax.Array)):
        raise TypeError(f"block_mask's statuses must be a JAX or NumPy array, got "
                        f"{type(statuses).__module__}.{type(statuses).__qualname__}: make the block mask with "
                        f"cuflash.mod.create_block_mask(..., like=q)")
    statuses = jnp.asarray(statuses)
    _options.check_block_mask(block_mask, _describe(q, q), batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                              statuses=_describe(statuses, q))
    return statuses


def _flatten_block_mask(bm: mod.BlockMask):
    return (bm.statuses, bm.mod_tensors), (bm.mask_mod, bm.tree, bm.batch, bm.heads, bm.seqlen_q, bm.seqlen_k)


def _unflatten_block_mask(static: tuple, leaves: tuple) -> mod.BlockMask:
    (statuses, mod_tensors), (mask_mod, tree, *sizes) = leaves, static
    return mod.BlockMask(mask_mod, mod_tensors, tree, statuses, *sizes)


# A BlockMask is a pytree: its statuses and mod tensors are its leaves (inputs of a jitted
# function that takes it, traced there), the mask and the sizes it was made for are static.
jax.tree_util.register_pytree_node(mod.BlockMask, _flatten_block_mask, _unflatten_block_mask)


def _describe(x, q) -> _arrays.ArrayInfo:
    """x as api's checks see it: shape, dtype, and CPU (None) or GPU (0) from q's platform."""
    device = None if _platform(q) == "cpu" else 0  # only CPU vs GPU matters to the checks
    shape = tuple(x.shape)
    return _arrays.ArrayInfo(x, "jax", 0, shape, _arrays.contiguous_strides(shape), np.dtype(x.dtype).name, device)


def _platform(x) -> str:
    """Where x's computation runs: its device for a concrete array. A tracer (under jit
    or grad) has no device yet; uncommitted work goes to the default device, so assume
    that (jax.default_device, else the default backend)."""
    try:
        return next(iter(x.devices())).platform
    except Exception:  # a tracer (ConcretizationTypeError) or a NumPy array (AttributeError)
        default = jax.config.jax_default_device
        if default is None:
            return jax.default_backend()
        return default if isinstance(default, str) else default.platform


def _check_alibi(alibi_slopes, nheads: int, batch: int):
    slopes = jnp.asarray(alibi_slopes)
    _options.check_alibi_layout(slopes.shape, np.dtype(slopes.dtype).name, nheads, batch)
    if not isinstance(slopes, jax.core.Tracer):
        _options.check_finite("alibi_slopes", np.asarray(slopes))
    return slopes


def _seed_words(seed):
    """An integer array seed (or a typed PRNG key) as uint32 [low, high]."""
    seed = jnp.asarray(seed)
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"seed must be an int, an integer array or a PRNG key, got dtype {seed.dtype}")
    words = jax.lax.bitcast_convert_type(seed, jnp.uint32) if seed.dtype.itemsize >= 4 else seed.astype(jnp.uint32)
    words = words.reshape(-1)
    if words.shape[0] > 2:
        raise ValueError(f"seed must hold at most 64 bits (two uint32 words), got {words.shape[0]} words")
    return jnp.concatenate([words, jnp.zeros(2 - words.shape[0], jnp.uint32)])


def _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """int32 (batch + 1,) offsets; their values too when they are concrete."""
    checked = []
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        cu = jnp.asarray(cu)
        values = None if isinstance(cu, jax.core.Tracer) else np.asarray(cu)
        _options.check_cu_seqlens(name, cu.shape, np.dtype(cu.dtype).name, values, total, max_len)
        checked.append(cu)
    _options.check_batches(checked[0].shape, checked[1].shape)
    return checked


def _attention(q, k, v, extras, config):
    """(out, lse). Inside jax.shard_map, q, k and v first take every mesh axis any of them
    varies over: the callbacks' results carry no such type, and JAX transposes the cast of
    an input that does not vary (k and v shared by the devices) into the sum of its
    gradient over the axis."""
    axes = _vma(q, k, v)
    q, k, v = (_varying(x, axes) for x in (q, k, v))
    return _attention_vjp(q, k, v, extras, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_vjp(q, k, v, extras, config):
    return _forward(q, k, v, extras, config)


def _attention_fwd(q, k, v, extras, config):
    out, lse = _forward(q, k, v, extras, config)
    return (out, lse), (q, k, v, out, lse, extras)


def _attention_bwd(config, residuals, cotangents):
    q, k, v, out, lse, extras = residuals
    dout, dlse = cotangents
    # alibi slopes, seeds and offsets get no gradient: a zero cotangent for each.
    return (*_backward(dout, dlse, q, k, v, out, lse, extras, config), jax.tree.map(_zero_cotangent, extras))


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


def _lse_shape(q, config: _Config):
    return (q.shape[1], q.shape[0]) if config.varlen else (q.shape[0], q.shape[2], q.shape[1])


def _forward(q, k, v, extras: dict, config: _Config):
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(_lse_shape(q, config), jnp.float32))
    workspace = {}
    if _platform(q) != "cpu":  # the sm_90a forward's scratch (tile counter, tail pieces): shapes from the plan
        described = {name: _describe(x, q) for name, x in (("q", q), ("k", k), ("v", v), *extras.items())}
        mods = None if config.mods is None else _options.DeviceMods(
            config.mods.source, tuple(described[name] for name in config.mods.names), described.get("block_mask"))
        options = _options.Options(config.causal, config.scale, config.window, config.softcap,
                                   described.get("alibi_slopes"), config.dropout_p, mods=mods)
        varlen = None
        if config.varlen:
            varlen = _options.Varlen(described["cu_seqlens_q"], described["cu_seqlens_k"], *config.max_seqlens)
        plan = _plan.forward(described["q"], described["k"], described["v"], described["q"], options, varlen,
                             _device.facts(0))  # (for the workspace's shapes: no compiled kernel's facts)
        workspace = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in plan.workspace}
    call = buffer_callback(_ForwardCallback(config, tuple(workspace)), (*results, workspace),
                           vmap_method="sequential")
    out, lse, _ = call(q, k, v, *(extras[name] for name in config.inputs))
    return _varying(out, _vma(q)), _varying(lse, _vma(q))


def _backward(dout, dlse, q, k, v, out, lse, extras: dict, config: _Config):
    grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    ordered = config.deterministic and _plan.backward_orders(q.shape[-1], config.extras, "block_mask" in config.inputs,
                                                             _sm90a())
    work = _plan.backward_workspace(tuple(q.shape), config.deterministic, config.extras, ordered)
    workspace = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in work.items()}
    call = buffer_callback(_BackwardCallback(config), (grads, workspace), vmap_method="sequential")
    grads, _ = call(dout, dlse, q, k, v, out, lse, *(extras[name] for name in config.inputs))
    return tuple(_varying(g, _vma(q)) for g in grads)


def _sm90a() -> bool:
    """Does JAX's first device run the sm_90a kernels? At trace time a call's own device is
    not known; a guess that proves wrong costs only the deterministic backward's speed (the
    planner takes the workspace it is given)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and _device.facts(getattr(device, "local_hardware_id", device.id)).sm90a


def _varying(x, axes):
    """x typed as varying over the mesh axes ``axes`` (inside jax.shard_map): a callback's
    result carries no such type, and one typed invariant would have its cotangents summed
    over the axis by JAX, though each device's value is its own."""
    missing = tuple(a for a in sorted(axes, key=str) if a not in _vma(x))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)


def _vma(*arrays) -> frozenset:
    """The mesh axes over which any of ``arrays`` varies (none outside jax.shard_map): the
    type's manual_axis_type (JAX 0.10), or its vma (JAX 0.7 to 0.9)."""
    axes = frozenset()
    for x in arrays:
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))
    return axes


# command_buffer_compatible stays off: with it XLA would run the Python once and replay a
# recorded CUDA graph, but the first call compiles the kernel with NVRTC, which must not
# happen inside a capture.


@dataclasses.dataclass(frozen=True)
class _ForwardCallback:
    config: _Config
    workspace: tuple[str, ...]  # the plan's scratch buffers, in its order

    def __call__(self, ctx, outputs, q, k, v, *extras):
        extras = dict(zip(self.config.inputs, extras))
        if _on_cpu(q):
            return _write(outputs, _call_cpu(api.attention, api.attention_varlen, self.config, [q, k, v], extras,
                                             return_lse=True))
        out, lse, workspace = outputs
        dtype = self.config.dtype
        options, varlen = _gpu_options(self.config, extras, q, ctx.stream)
        _kernels.forward(*(_info(x, dtype) for x in (q, k, v, out)), _info(lse, "float32"), options,
                         stream=ctx.stream, varlen=varlen,
                         workspace=tuple(_info(workspace[name], "float32") for name in self.workspace))


@dataclasses.dataclass(frozen=True)
class _BackwardCallback:
    config: _Config

    def __call__(self, ctx, outputs, dout, dlse, q, k, v, out, lse, *extras):
        extras = dict(zip(self.config.inputs, extras))
        grads, workspace = outputs
        if _on_cpu(q):
            # The workspace is GPU scratch; unused here.
            return _write(grads, _call_cpu(api.attention_backward, api.attention_varlen_backward, self.config,
                                           [dout, q, k, v, out, lse], extras,
                                           deterministic=self.config.deterministic, dlse=np.asarray(dlse)))
        dtype = self.config.dtype
        options, varlen = _gpu_options(self.config, extras, q, ctx.stream)
        inputs = [_info(x, dtype) for x in (dout, q, k, v, out)] + [_info(lse, "float32")]
        grads = [_info(x, dtype) for x in grads]
        accum, semaphore = workspace.get("dq_accum"), workspace.get("dq_semaphore")
        _kernels.backward(*inputs, *grads, _info(workspace["delta"], "float32"), options, stream=ctx.stream,
                          varlen=varlen, dq_accum=None if accum is None else _info(accum, "float32"),
                          dlse=_info(dlse, "float32"),
                          dq_semaphore=None if semaphore is None else _info(semaphore, "int32"))


def _call_cpu(dense, packed, config: _Config, arrays: list, extras: dict, **kwargs):
    """The NumPy path on host views of the buffers."""
    host = {name: np.asarray(b) for name, b in extras.items()}
    options = dict(causal=config.causal, softmax_scale=config.scale, window_size=config.window,
                   softcap=config.softcap, alibi_slopes=host.get("alibi_slopes"), dropout_p=config.dropout_p,
                   seed=_host_seed(config, host.get("seed")), **kwargs)
    if config.mods is not None:
        tensors = tuple(host[name] for name in config.mods.names)
        if config.mods.blocks:  # (the shapes were checked while tracing; the statuses' shape is checked again)
            options.update(score_mod=config.mods.score_mod, block_mask=mod.BlockMask(
                config.mods.mask_mod, tensors, config.mods.mask_tree, host["block_mask"], None, None, None, None))
        else:
            options.update(score_mod=config.mods.score_mod, mask_mod=config.mods.mask_mod, mod_tensors=tensors)
    arrays = [np.asarray(b) for b in arrays]
    if not config.varlen:
        return dense(*arrays, **options)
    return packed(*arrays, host["cu_seqlens_q"], host["cu_seqlens_k"], *config.max_seqlens, **options)


def _gpu_options(config: _Config, extras: dict, q, stream: int):
    """The kernels' Options and Varlen from the static config and the device buffers."""
    alibi = extras.get("alibi_slopes")
    seed_words = extras.get("seed")
    if seed_words is not None:
        seed_words = _device_to_host(seed_words, np.uint32, stream)
    mods = None
    if config.mods is not None:
        blocks = _info(extras["block_mask"], "int8") if config.mods.blocks else None
        mods = _options.DeviceMods(config.mods.source, tuple(
            _info(extras[name], dtype) for name, dtype in zip(config.mods.names, config.mods.dtypes)), blocks)
    options = _options.Options(config.causal, config.scale, config.window, config.softcap,
                               None if alibi is None else _info(alibi, "float32"), config.dropout_p,
                               _host_seed(config, seed_words) or 0, 0, mods)
    varlen = None
    if config.varlen:
        varlen = _options.Varlen(_info(extras["cu_seqlens_q"], "int32"), _info(extras["cu_seqlens_k"], "int32"),
                                 *config.max_seqlens)
    return options, varlen


def _host_seed(config: _Config, words) -> int | None:
    if words is None:
        return config.seed
    low, high = (int(w) for w in words)
    return low | high << 32


def _device_to_host(buffer, dtype, stream: int) -> np.ndarray:
    """A small device buffer's contents, read in stream order (this waits for the stream)."""
    import cupy
    host = np.empty(tuple(buffer.shape), dtype)
    ptr = buffer.__cuda_array_interface__["data"][0]
    with cupy.cuda.Device(buffer.__dlpack_device__()[1]):
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, ptr, host.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                      stream)
        cupy.cuda.runtime.streamSynchronize(stream)
    return host


def _on_cpu(buffer) -> bool:
    return buffer.__dlpack_device__()[0] == _DLPACK_CPU


def _info(buffer, dtype: str) -> _arrays.ArrayInfo:
    """A device buffer as the kernels see it. XLA hands custom calls dense row-major
    buffers. The dtype comes from the caller: bfloat16 buffers describe themselves as
    raw 2-byte records ('<V2') in __cuda_array_interface__."""
    shape = tuple(buffer.shape)
    ptr = buffer.__cuda_array_interface__["data"][0]
    device = buffer.__dlpack_device__()[1]
    return _arrays.ArrayInfo(buffer, "jax", ptr, shape, _arrays.contiguous_strides(shape), dtype, device)


def _write(buffers, arrays) -> None:
    # The CPU path returns fresh arrays; copy them into the buffers XLA allocated.
    for buffer, array in zip(buffers, arrays):
        np.asarray(buffer)[...] = array
