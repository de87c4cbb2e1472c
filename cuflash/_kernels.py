"""Launch the CUDA kernels on buffers that already exist.

A plan (``_plan``: variants, grids, Params), made for a device's facts (``device_facts``), is
bound here as it is to the kernels the compile layer loads (``_compile.load_kernel``) and
launched through the driver (``_driver``).

Every buffer is an ``ArrayInfo`` (pointer, shape, strides in elements, dtype,
device); options are an ``Options`` (validated by ``_options``). The framework glue
(torch custom op, JAX buffer_callback) calls ``forward`` and ``backward`` directly with
buffers its framework allocated and the stream it runs on. Dense arrays are (batch,
seqlen, nheads, headdim); packed variable-length arrays are (total, nheads, headdim)
with a ``Varlen`` describing the sequences.
"""
from __future__ import annotations

import ctypes
import math
import operator
import threading

from . import _compile, _device, _driver, _plan, _warm
from ._arrays import ArrayInfo
from ._options import KVCache, Options, Varlen

# None, or a callable(pointers, stream) that sees every launch's array pointers and stream
# (zero-copy and stream-order checks); experiment.observe_launches sets it.
launch_observer = None


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo | None, options: Options, *,
            stream: int, varlen: Varlen | None = None, workspace: tuple[ArrayInfo, ...] = ()) -> None:
    """out = attention(q, k, v) and its LSE ((batch, nheads, seqlen_q), or (nheads, total_q);
    contiguous, or None: not written). ``workspace``: scratch for the plan's workspace, in
    its order (the sm_90a forward's tile counter, or its tail pieces' results and counters),
    or () where the plan has none."""
    key = _plan_key((q, k, v, out), options, varlen)
    launcher = _warm.lookup(_launchers, key)
    if launcher is None:
        launcher = _remember(key, forward_launcher(q, k, v, out, options, varlen))
    needed = launcher.plan.workspace
    if needed and (len(workspace) < len(needed) or any(
            math.prod(w.shape) < math.prod(shape) for w, (_, shape, _) in zip(workspace, needed))):
        raise ValueError(f"this forward needs its workspace {needed}; given "
                         f"{[tuple(w.shape) for w in workspace]}")
    launcher(stream, q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr,
             *(w.ptr for w in workspace[:len(needed)]))


def forward_launcher(q, k, v, out, options: Options, varlen: Varlen | None) -> Launcher:
    """The forward of this call signature, ready to launch with (stream, q, k, v, out, lse pointers)."""
    return Launcher(_plan.forward(q, k, v, out, options, varlen, device_facts(q.device)), q.device)


def device_facts(device: int) -> _device.Device:
    """The facts of ``device`` that plans are made for (``_device.facts``), with the CTAs of
    a kernel one multiprocessor holds as the compile layer reads them when it loads the
    kernel (``_compile.load_kernel``)."""
    def resident_ctas(kernel) -> int:
        return _compile.resident_ctas(kernel, device)

    return _device.facts(device)._replace(resident_ctas=resident_ctas)


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
             dq: ArrayInfo, dk: ArrayInfo, dv: ArrayInfo, delta: ArrayInfo, options: Options, *, stream: int,
             varlen: Varlen | None = None, dq_accum: ArrayInfo | None = None, dlse: ArrayInfo | None = None,
             dq_semaphore: ArrayInfo | None = None) -> None:
    """dq, dk, dv of attention; delta, dq_accum and dq_semaphore come from
    ``_plan.backward_workspace``.
    ``dlse``: the loss's gradient with respect to lse (laid out like it), or None where
    the loss does not use lse.
    With dq_accum, where the one-pass kernel has an instance (head dim, no softcap,
    ALiBi or dropout, shared memory of the device), it computes all three, dQ through
    fp32 atomics; otherwise dQ has its own pass and every gradient is bitwise
    reproducible (with dq_semaphore too, on the sm_90a backward). dK and dV always are."""
    arrays = (dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, dq_accum, dq_semaphore)
    key = _plan_key(arrays, options, varlen)
    launcher = _warm.lookup(_launchers, key)
    if launcher is None:
        launcher = _remember(key, backward_launcher(dout, q, k, v, out, dq, dk, dv, dq_accum, options, varlen,
                                                    dq_semaphore))
    launcher(stream, *(0 if a is None else a.ptr for a in arrays))


def backward_launcher(dout, q, k, v, out, dq, dk, dv, dq_accum, options: Options, varlen: Varlen | None,
                      dq_semaphore: ArrayInfo | None = None) -> Launcher:
    """The backward of this call signature, ready to launch with (stream, dout, q, k, v,
    out, lse, dlse, dq, dk, dv, delta, dq_accum, dq_semaphore pointers). (dlse, like every
    pointer, is given at launch: the plan is the same with or without it.)"""
    plan = _plan.backward(dout, q, k, v, out, dq, dk, dv, dq_accum, options, varlen, device_facts(q.device),
                          dq_semaphore)
    return Launcher(plan, q.device)


def decode_launcher(arrays: dict, out: ArrayInfo, cache: KVCache, options: Options,
                    varlen: Varlen | None = None) -> Launcher:
    """The KV-cache call of this signature (``arrays``: q, k_cache, v_cache and k, v when
    given), or with ``varlen`` the varlen call over a paged cache; its plan's workspace
    names the scratch buffers ``decode_pointers`` takes."""
    q = arrays["q"]
    key = _decode_key(arrays, out, cache, options) if varlen is None else None
    launcher = _warm.lookup(_launchers, key)
    if launcher is None:
        def plan(device: _device.Device) -> _plan.Plan:
            return _plan.decode(q, arrays["k_cache"], arrays["v_cache"], arrays.get("k"), arrays.get("v"), out,
                                cache, options, device, varlen)
        facts = device_facts(q.device)
        chosen = plan(facts)
        if not all(_one_wave_of_clusters(step, q.device) for step in chosen.steps):
            chosen = plan(facts._replace(clusters=False))
        launcher = _remember(key, Launcher(chosen, q.device))
    return launcher


def _one_wave_of_clusters(step: _plan.Step, device: int) -> bool:
    """Does the GPU hold every cluster of ``step`` at once (true of a step without clusters)?
    The splits of a cluster wait for each other, so a second wave would wait for the first.
    (The planner gives clusters only to grids of a CTA a multiprocessor or less; a GPC
    short of multiprocessors for a cluster of large CTAs can still hold fewer.)"""
    if step.cluster == 1:
        return True
    launch = _driver.LaunchEx(_compile.load_kernel(step.kernel, device), step.grid, step.kernel.threads,
                              step.kernel.shared_bytes, step.cluster)
    with _driver.in_context(device):
        return launch.resident_clusters() * step.cluster >= math.prod(step.grid)


def decode_pointers(pointers: dict, out: int, lse: int, partial_o: int, partial_lse: int) -> tuple[int, ...]:
    """The pointers of a KV-cache launch, in _plan.DECODE_POINTERS' order: ``pointers``
    holds the call's arrays' addresses by argument name (q, k_cache, ..., alibi_slopes, and
    for the varlen call cu_seqlens_q and cu_seqlens_k), those given; lse is 0 where not
    returned."""
    get = pointers.get
    return (pointers["q"], out, pointers["k_cache"], pointers["v_cache"], get("k", 0), get("v", 0), lse,
            partial_o, partial_lse, get("cache_seqlens", 0), get("cache_batch_idx", 0), get("cache_leftpad", 0),
            get("block_table", 0), get("rotary_cos", 0), get("rotary_sin", 0), get("alibi_slopes", 0),
            get("cu_seqlens_q", 0), get("cu_seqlens_k", 0), partial_o, partial_lse, out, lse)


def _decode_key(arrays: dict, out: ArrayInfo, cache: KVCache, options: Options):
    """What a KV-cache plan depends on: every array's layout, the options but ALiBi's
    pointer, and the cache's shape-like values (an int cache_seqlens is one)."""
    described = [*arrays.values(), out, *(a for a in (cache.batch_idx, cache.leftpad, cache.block_table,
                                                      cache.rotary_cos, options.alibi) if a is not None)]
    layouts = tuple((a.shape, a.strides, a.dtype, a.device, a.ptr % 16 == 0) for a in described)
    return ("decode", layouts, tuple(arrays), options._replace(alibi=None), options.alibi is None,
            cache.cache_seqlens if isinstance(cache.cache_seqlens, int) else None, cache.capacity,
            cache.rotary_interleaved, cache.num_splits, cache.deterministic)


def merge_launcher(parts: ArrayInfo, lses: ArrayInfo, out: ArrayInfo) -> Launcher:
    """merge_states of stacked parts into ``out``, launched with (parts, lses, out, out_lse)."""
    return Launcher(_plan.merge(parts, lses, out), parts.device)


# Warm calls of callers without their own cache (JAX): what a dense call signature
# launches is bound once. ALiBi (its pointer), dropout (a fresh seed each call) and
# packed sequences (their cu_seqlens pointers) are planned each call.
_launchers: dict = {}


def _cacheable(options: Options, varlen: Varlen | None) -> bool:
    """Is a plan for these options the same for every call of one signature?"""
    return varlen is None and options.alibi is None and options.dropout_p == 0 and options.mods is None


def _plan_key(arrays, options: Options, varlen: Varlen | None):
    if not _cacheable(options, varlen):
        return None
    return tuple((a.shape, a.strides, a.dtype, a.device, a.ptr % 16 == 0) for a in arrays if a is not None), options


def _remember(key, launcher: Launcher) -> Launcher:
    _warm.remember(_launchers, key, launcher)
    return launcher


class Launcher:
    """A plan bound to its compiled kernels on one device. ``launcher(stream, *pointers)``
    writes the pointers into its Params and launches every step. The Params and the
    kernel-argument arrays are built once: the driver copies the arguments at launch, so
    one buffer serves every call (a second thread launching the same plan at once takes
    a copy)."""

    def __init__(self, plan: _plan.Plan, device: int):
        self.plan, self.device = plan, device
        self.params = plan.struct.from_buffer_copy(plan.params)
        offsets = _plan.pointer_offsets(plan.struct, plan.pointers)
        assert all(offset % 8 == 0 for offset in offsets), "pointers lie at multiples of 8 bytes"
        self._pointer_words = tuple(offset // 8 for offset in offsets)
        self.context = _driver.primary_context(device)
        self._steps = [(_compile.load_kernel(s.kernel, device), s.grid, s.kernel.threads, s.kernel.shared_bytes,
                        _plan.field_offset(plan.struct, s.argument) if s.argument else 0,
                        tuple(map(ctypes.c_int, s.args)), s.cluster, s.dependent) for s in plan.steps]
        self._maps = [(_plan.field_offset(plan.struct, m.field), plan.pointers.index(m.pointer), m)
                      for m in plan.maps]
        # The pointers the maps hold (their arrays' addresses), and those self.params' maps were
        # encoded for: a call whose mapped arrays did not move encodes nothing.
        self._map_pointers = operator.itemgetter(*(index for _, index, _ in self._maps)) if self._maps else None
        self._mapped = None
        # The counters the steps count on from 0: (pointer index, 4-byte words) each.
        self._zeroed = tuple((plan.pointers.index(name), math.prod(shape))
                             for name, shape, _ in plan.workspace if name in plan.counters)
        self._lock = threading.Lock()
        self._words, self._calls = self._bind(self.params)

    def _bind(self, params: ctypes.Structure) -> tuple[ctypes.Array, list[tuple]]:
        """``params`` as 64-bit words, where the pointers go (their offsets are multiples of
        8), and cuLaunchKernel's arguments but the stream, for each step, over ``params``."""
        words = (ctypes.c_uint64 * (ctypes.sizeof(params) // 8)).from_buffer(params)
        calls = []
        for function, grid, threads, shared, at, args, cluster, dependent in self._steps:
            arguments = (ctypes.c_void_p * (1 + len(args)))(ctypes.addressof(params) + at,
                                                             *map(ctypes.addressof, args))
            extended = (_driver.LaunchEx(function, grid, threads, shared, cluster, dependent)
                        if cluster > 1 or dependent else None)
            calls.append((function, *grid, threads, shared, arguments, ctypes.addressof(arguments), extended))
        return words, calls

    def __call__(self, stream: int, *pointers: int) -> None:
        if not self._calls:  # an empty call: nothing to launch
            return
        if self._zeroed and not all(index < len(pointers) and pointers[index] for index, _ in self._zeroed):
            raise ValueError(f"this launch needs its workspace {self.plan.workspace}: its pointers follow the "
                             f"arrays' ({self.plan.pointers})")
        if self._lock.acquire(blocking=False):
            try:
                if self._maps:
                    mapped = self._map_pointers(pointers)
                    if mapped != self._mapped:
                        self._encode_maps(self.params, pointers)
                        self._mapped = mapped
                self._launch(self.params, self._words, self._calls, stream, pointers)
            finally:
                self._lock.release()
        else:  # another thread is launching this plan: a copy of its arguments
            params = self.plan.struct.from_buffer_copy(self.params)
            if self._maps:
                self._encode_maps(params, pointers)
            self._launch(params, *self._bind(params), stream, pointers)

    def _encode_maps(self, params: ctypes.Structure, pointers: tuple) -> None:
        """The plan's tensor maps, for arrays at these addresses (a map holds its array's).
        The driver encodes them in a current context, which a thread that has made no CUDA
        call yet lacks (autograd's backward thread)."""
        from . import _tensormap
        with _driver.in_context(self.device):
            for offset, index, spec in self._maps:
                encoded = _tensormap.encode(pointers[index], spec.dtype, spec.shape, spec.strides, spec.rows)
                ctypes.memmove(ctypes.addressof(params) + offset, ctypes.addressof(encoded), ctypes.sizeof(encoded))

    def _launch(self, params: ctypes.Structure, words: ctypes.Array, calls: list, stream: int,
                pointers: tuple) -> None:
        for word, pointer in zip(self._pointer_words, pointers):
            words[word] = pointer  # (a nested field's setattr costs 3x as much, struct.pack_into 1.8x)
        if launch_observer is not None:
            launch_observer(params.pointers(), stream)
        launch, current_context = _driver.launcher()
        if current_context() == self.context:
            self._launch_steps(launch, calls, stream, pointers)
        else:
            with _driver.in_context(self.device):
                self._launch_steps(launch, calls, stream, pointers)

    def _launch_steps(self, launch, calls: list, stream: int, pointers: tuple) -> None:
        for index, words in self._zeroed:
            _driver.zero_words(pointers[index], words, stream)
        for function, x, y, z, threads, shared, argument_array, arguments, extended in calls:
            if extended is None:
                launch(function, x, y, z, threads, 1, 1, shared, stream, arguments, 0)
            else:
                extended.launch(stream, argument_array)

