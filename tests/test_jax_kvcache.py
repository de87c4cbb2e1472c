"""cuflash.jax.attention_with_kvcache on CPU arrays: the NumPy call's results, the caches
returned (and, donated under jit, written in place), checks while tracing."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
pytest.importorskip("jax.experimental.buffer_callback", reason="cuflash.jax needs JAX 0.7 or newer")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax  # noqa: E402

from .strategies import kvcache_calls  # noqa: E402
from .test_kvcache import make_call  # noqa: E402

CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These are CPU-path tests: arrays made without a device stay on the CPU, also where
    JAX's default device is a GPU."""
    with jax.default_device(CPU):
        yield


def _jax(kw: dict) -> dict:
    return {name: jax.device_put(x, CPU) if isinstance(x, np.ndarray) else x for name, x in kw.items()}


@settings(deadline=None, max_examples=40)
@given(call=st.one_of(kvcache_calls(), kvcache_calls(paged=True)), jit=st.booleans())
def test_the_jax_call_is_the_numpy_call(call, jit):
    rng = np.random.default_rng(call["seed"])
    q, k_cache, v_cache, k, v, kw = make_call(call, np.float32, rng)
    jq, jk_cache, jv_cache, jk, jv = (None if x is None else jax.device_put(x, CPU)
                                      for x in (q, k_cache, v_cache, k, v))
    want_out, want_lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **kw)
    arrays = {name: x for name, x in _jax(kw).items() if not isinstance(x, (bool, tuple, float))}
    static = {name: x for name, x in kw.items() if name not in arrays}

    def step(q, k_cache, v_cache, k, v, arrays):
        return cuflash.jax.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **arrays, **static)

    out, lse, new_k, new_v = (jax.jit(step) if jit else step)(jq, jk_cache, jv_cache, jk, jv, arrays)
    assert (np.asarray(out) == want_out).all() and (np.asarray(lse) == want_lse).all()
    assert (np.asarray(new_k) == k_cache).all() and (np.asarray(new_v) == v_cache).all()


def test_donated_caches_are_written_in_place():
    q, k, v = (jax.device_put(np.ones(s, np.float32), CPU) for s in ((1, 1, 2, 8), (1, 1, 1, 8), (1, 1, 1, 8)))
    # (jnp.zeros: buffers JAX owns; device_put may borrow a NumPy array's memory, which it cannot donate)
    caches = [jnp.zeros((1, 6, 1, 8), jnp.float32, device=CPU) for _ in "kv"]
    step = jax.jit(lambda q, kc, vc, k, v, n: cuflash.jax.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n),
                   donate_argnums=(1, 2))
    pointers = [c.unsafe_buffer_pointer() for c in caches]
    out, k_cache, v_cache = step(q, *caches, k, v, jnp.array([2], jnp.int32))
    assert [c.unsafe_buffer_pointer() for c in (k_cache, v_cache)] == pointers
    assert (np.asarray(k_cache)[0, 2] == 1).all() and (np.asarray(k_cache)[0, 3:] == 0).all()
    weight = np.exp(np.sqrt(8))  # key 2 (ones) scores 8 / sqrt(8); keys 0 and 1 (zeros) score 0
    assert np.allclose(np.asarray(out), weight / (2 + weight))  # values 0, 0, 1


def test_checks_while_tracing():
    q = jnp.ones((2, 1, 2, 8))
    caches = [jnp.zeros((2, 4, 1, 8)) for _ in "kv"]
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        cuflash.jax.attention_with_kvcache(q, *caches, cache_seqlens=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="at most the cache's length"):
        cuflash.jax.attention_with_kvcache(q, *caches, jnp.ones((2, 1, 1, 8)), jnp.ones((2, 1, 1, 8)),
                                           cache_seqlens=jnp.array([4, 0], jnp.int32))
    # Traced lengths: not readable while tracing, so no value check (and no error) there.
    traced = jax.jit(lambda n: cuflash.jax.attention_with_kvcache(q, *caches, cache_seqlens=n)[0])
    assert traced(jnp.array([1, 2], jnp.int32)).shape == q.shape


def test_merged_halves_train_like_the_whole():
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 4, 8)).astype(np.float32)) for _ in range(3))

    def whole(q, k, v):
        return cuflash.jax.attention(q, k, v).sum()

    def merged(q, k, v):
        halves = [cuflash.jax.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 3), slice(3, 5))]
        return cuflash.jax.merge_states([h[0] for h in halves], [h[1] for h in halves])[0].sum()

    assert np.allclose(merged(q, k, v), whole(q, k, v), atol=1e-5)
    for got, want in zip(jax.jit(jax.grad(merged, (0, 1, 2)))(q, k, v), jax.grad(whole, (0, 1, 2))(q, k, v)):
        assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_paged_varlen_is_the_numpy_call(jit):
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 2, 3, 6], np.int32), np.array([0, 7, 7, 19], np.int32)
    q = rng.standard_normal((6, 4, 8)).astype(np.float32)
    k_pages, v_pages = (rng.standard_normal((9, 5, 2, 8)).astype(np.float32) for _ in "kv")
    table = rng.permutation(9)[:9].reshape(3, 3).astype(np.int32)
    kw = dict(causal=True, return_lse=True)
    want = cuflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 3, 12, block_table=table, **kw)

    def step(*arrays):
        return cuflash.jax.attention_varlen(*arrays[:5], 3, 12, block_table=arrays[5], **kw)

    got = (jax.jit(step) if jit else step)(*(jax.device_put(x, CPU) for x in (q, k_pages, v_pages, cu_q, cu_k, table)))
    assert (np.asarray(got[0]) == want[0]).all() and (np.asarray(got[1]) == want[1]).all()
