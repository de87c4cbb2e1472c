"""cuflash.jax.ring_attention: context parallelism over a mesh axis inside jax.shard_map.

The ring runs on 2 and 4 CPU devices, which XLA makes only when
--xla_force_host_platform_device_count is set before JAX starts: so one subprocess
(``python -m tests.test_jax_ring``) runs every ring case under jax.jit and reports each
case's failure, or none, as one JSON line; the tests here read that report. Each case draws
the whole sequence, orders it as the layout deals it out (contiguous, or zigzag's chunks
0, 2n-1, 1, 2n-2, ...), runs the ring's forward and its vjp fed dout and dlse, and checks
out, lse and the gradients of q, k and v against the float64 oracle over the whole
sequence by flash-attn's rule, as tests/test_ring.py does for torch. The world of one and
the argument errors need a single device and run in this process.
"""
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import traceback

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
pytest.importorskip("jax.experimental.buffer_callback", reason="cuflash.jax needs JAX 0.7 or newer")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax  # noqa: E402
from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_reference,  # noqa: E402
                               attention_reference_backward)

from .strategies import assert_close, rounding_floor  # noqa: E402

try:
    shard_map = jax.shard_map
except AttributeError:  # JAX before 0.7.1
    from jax.experimental.shard_map import shard_map

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 4

# (batch, seqlen_local, nheads, nheads_kv, headdim) per world: odd zigzag chunks (5, 3), GQA and MQA.
SHAPES = {2: (1, 10, 4, 2, 16), 4: (2, 6, 4, 1, 16)}

# (world, layout, causal, dtype, return_lse, jit, mesh): every world, layout and mask in
# float32; float16 twice; a loss through out alone; an eager call; the ring over one axis
# of a two-axis mesh whose other axis shards the batch.
CASES = ([(world, layout, causal, "float32", True, True, "1d") for world in (2, 4)
          for layout in ("contiguous", "zigzag") for causal in (False, True)]
         + [(2, "zigzag", True, "float16", True, True, "1d"), (4, "contiguous", True, "float16", True, True, "1d"),
            (4, "zigzag", True, "float32", False, True, "1d"), (2, "zigzag", True, "float32", True, False, "1d"),
            (2, "zigzag", True, "float32", True, True, "2d")])


def _case_id(case) -> str:
    world, layout, causal, dtype, return_lse, jit, mesh = case
    return (f"{world}dev-{layout}-{'causal' if causal else 'full'}-{dtype}{'' if return_lse else '-out-only'}"
            f"{'' if jit else '-eager'}{'-2d-mesh' if mesh == '2d' else ''}")


def _order(seqlen: int, world: int, layout: str) -> np.ndarray:
    """The token order of the global array whose contiguous shards are the layout's."""
    tokens = np.arange(seqlen)
    if layout == "contiguous":
        return tokens
    chunks = np.split(tokens, 2 * world)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * world - 1 - i]]) for i in range(world)])


def _check_case(world, layout, causal, dtype, return_lse, jit, mesh_kind, seed) -> None:
    batch, seqlen_local, nheads, nheads_kv, headdim = SHAPES[world]
    if mesh_kind == "2d":  # batch over "dp", sequence over "sp"
        batch *= 2
        mesh = Mesh(np.array(jax.devices()[:2 * world]).reshape(2, world), ("dp", "sp"))
        spec, lse_spec = P("dp", "sp"), P("dp", None, "sp")
    else:
        mesh = Mesh(np.array(jax.devices()[:world]), ("sp",))
        spec, lse_spec = P(None, "sp"), P(None, None, "sp")
    seqlen = seqlen_local * world
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype).type
    q = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(np_dtype)
    k, v = (rng.standard_normal((batch, seqlen, nheads_kv, headdim)).astype(np_dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np_dtype)
    dlse = rng.standard_normal((batch, nheads, seqlen)).astype(np.float32) if return_lse else None

    order = _order(seqlen, world, layout)
    back = np.argsort(order)
    ring = shard_map(functools.partial(cuflash.jax.ring_attention, axis_name="sp", causal=causal, layout=layout,
                                       return_lse=return_lse),
                     mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec) if return_lse else spec)

    def run(q, k, v, cotangents):
        results, vjp = jax.vjp(ring, q, k, v)
        return results, vjp(cotangents)

    cotangents = (dout[:, order], dlse[:, :, order]) if return_lse else dout[:, order]
    results, grads = (jax.jit(run) if jit else run)(q[:, order], k[:, order], v[:, order], cotangents)
    out, lse = results if return_lse else (results, None)
    assert out.dtype == q.dtype and out.shape == q.shape

    where = f"{world} devices {layout} causal={causal} {dtype}"
    out_ref, lse_ref = attention_reference(q, k, v, causal=causal)
    out_low = attention_lowp(q, k, v, causal=causal)
    allowed = 2 * np.abs(out_low - out_ref).max() + rounding_floor(out_ref, np_dtype)
    assert_close(np.asarray(out)[:, back], out_ref, atol=allowed, name=f"out ({where})")
    if return_lse:
        assert lse.dtype == jnp.float32 and lse.shape == (batch, nheads, seqlen)
        _, lse_one = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        allowed = 2 * np.abs(lse_one - lse_ref).max() + rounding_floor(lse_ref, np.float32)
        assert_close(np.asarray(lse)[:, :, back], lse_ref, atol=allowed, name=f"lse ({where})")

    want = attention_reference_backward(dout, q, k, v, causal=causal, dlse=dlse)
    lowp = attention_lowp_backward(dout, q, k, v, causal=causal, dlse=dlse)
    # D = rowsum(dO O) comes from the out stored in the input dtype, as FlashAttention takes it.
    stored = attention_reference_backward(dout, q, k, v, causal=causal, dlse=dlse, out=out_ref.astype(np_dtype))
    for name, got, x, exact, yardstick, inherited in zip(("dq", "dk", "dv"), grads, (q, k, v), want, lowp, stored):
        assert got.dtype == x.dtype and got.shape == x.shape
        allowed = (3 * np.abs(yardstick - exact).max() + rounding_floor(exact, np_dtype)
                   + np.abs(inherited - exact).max())
        assert_close(np.asarray(got)[:, back], exact, atol=allowed, name=f"{name} ({where})")


def _run_cases() -> None:
    """The subprocess: every case, then one JSON line {case id: failure text or null}."""
    assert len(jax.devices()) >= DEVICES, f"XLA made {len(jax.devices())} CPU devices, not {DEVICES}"
    report = {}
    for seed, case in enumerate(CASES):
        try:
            _check_case(*case, seed)
            report[_case_id(case)] = None
        except Exception:
            report[_case_id(case)] = traceback.format_exc(limit=-3)
    print(json.dumps(report))


@pytest.fixture(scope="module")
def ring_report() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    done = subprocess.run([sys.executable, "-m", "tests.test_jax_ring"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"the ring subprocess exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_ring_matches_the_whole_sequence(ring_report, case):
    failure = ring_report[_case_id(case)]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def test_one_device_is_plain_attention():
    """A ring of one: no transfer, cuflash.jax.attention's result and gradients, bit for bit."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    spec, lse_spec = P(None, "sp"), P(None, None, "sp")
    ring = shard_map(functools.partial(cuflash.jax.ring_attention, axis_name="sp", causal=True, return_lse=True),
                     mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec))

    def plain(q, k, v):
        return cuflash.jax.attention(q, k, v, causal=True, return_lse=True)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: (lambda o, l: o.sum() + l.sum())(*f(q, k, v)),
                                          argnums=(0, 1, 2)))

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (2, 10, 4, 16)) for key in keys)
    for got, want in zip(jax.tree.leaves((jax.jit(ring)(q, k, v), loss(ring)(q, k, v))),
                         jax.tree.leaves((jax.jit(plain)(q, k, v), loss(plain)(q, k, v)))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- input errors: raised while tracing, before any transfer ------------------------------------


def _qkv(seqlen=8, dtype=jnp.float32):
    return jnp.zeros((1, seqlen, 4, 16), dtype), jnp.zeros((1, seqlen, 2, 16), dtype), \
        jnp.zeros((1, seqlen, 2, 16), dtype)


def _ring(*args, **kwargs):
    return cuflash.jax.ring_attention(*args, **{"axis_name": "sp", **kwargs})


@pytest.mark.parametrize("call,error,message", [
    (lambda: _ring(*_qkv(), layout="striped"), ValueError,
     "layout must be one of 'contiguous', 'zigzag', got 'striped'"),
    (lambda: _ring(*_qkv(7)), ValueError, "seqlen_local must be even with layout='zigzag'"),
    (lambda: _ring(*_qkv(0), layout="contiguous"), ValueError, "seqlen_local must be positive"),
    (lambda: _ring(_qkv()[0], *_qkv(6)[1:]), ValueError, "k and v must hold as many tokens as q"),
    (lambda: _ring(np.zeros((1, 8, 4, 16), np.float32), *_qkv()[1:]), TypeError, "q must be a JAX array"),
    (lambda: _ring(_qkv()[0][:, :, :3], *_qkv()[1:]), ValueError, "q's nheads must be a multiple of k/v's nheads"),
    (lambda: _ring(*_qkv(dtype=jnp.bfloat16)), TypeError, "on cpu, got bfloat16"),
    (lambda: _ring(*_qkv(), causal=1), TypeError, "causal must be a bool"),
    (lambda: _ring(*_qkv(), softmax_scale=-1.0), ValueError, "softmax_scale must be"),
    (lambda: _ring(*_qkv(), return_lse="yes"), TypeError, "return_lse must be a bool"),
    (lambda: _ring(*_qkv()), NameError, "must be called inside jax.shard_map over a mesh with an axis named 'sp'"),
    (lambda: shard_map(functools.partial(_ring, axis_name="cp"), mesh=Mesh(np.array(jax.devices()[:1]), ("sp",)),
                       in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))(*_qkv()), NameError,
     "an axis named 'cp'"),
], ids=["layout", "zigzag-odd", "empty", "seqlen-mismatch", "not-an-array", "gqa", "bfloat16-cpu", "causal",
        "scale", "return-lse", "no-shard-map", "wrong-axis"])
def test_input_errors(call, error, message):
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(error, match=re.escape(message)):
        call()


if __name__ == "__main__":
    _run_cases()
