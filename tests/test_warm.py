"""Warm-call keys (cuflash/_warm.py) on the CPU: a stand-in array type whose library
reads a signature, as CuPy's and torch's do on the GPU, so that what makes two calls one
signature (and what does not) is checked everywhere."""
import numpy as np
import pytest

from cuflash import _arrays, _kernels, _warm, api, kvcache


class StandIn:
    def __init__(self, shape=(1, 8, 2, 16), strides=(512, 32, 16, 1), dtype="float16", ptr=256):
        self.shape, self.strides, self.dtype, self.ptr = shape, strides, dtype, ptr


class StandInCalls:
    @staticmethod
    def signature(x):
        return 0, x.shape, x.strides, x.dtype, x.ptr % 16 == 0


@pytest.fixture(autouse=True)
def stand_in_library(monkeypatch):
    monkeypatch.setitem(_arrays._LIBRARIES, StandIn, StandInCalls())


SCALARS = (True, None, (-1, -1), 0.0, 0.0, None, 0, False)  # causal ... return_lse, as api.attention


def key(*arrays, scalars=SCALARS, alibi_slopes=None):
    return api._key(arrays or (StandIn(), StandIn(), StandIn()), scalars, alibi_slopes)


def replaced(index, value):
    return SCALARS[:index] + (value,) + SCALARS[index + 1:]


def test_the_same_call_is_one_key():
    assert key() == key() and hash(key()) == hash(key())
    table = {}
    _warm.remember(table, key(), "entry")
    assert _warm.lookup(table, key()) == "entry"


@pytest.mark.parametrize("other", [
    replaced(0, 1),               # causal=1: equal to True, refused by the checks
    replaced(2, (-1, -1.0)),      # a float in the window
    replaced(3, 0),               # softcap=0: an int, which the checks take but the key tells apart
    replaced(1, 0.125),           # another scale
    replaced(7, True),            # return_lse
])
def test_equal_values_of_other_types_or_other_values_are_other_keys(other):
    assert key(scalars=other) != key()


@pytest.mark.parametrize("array", [
    StandIn(shape=(1, 8, 2, 32)),                      # another shape
    StandIn(strides=(512, 16, 256, 1)),                # another layout of the same shape
    StandIn(dtype="bfloat16"),
    StandIn(ptr=258),                                  # not 16-byte aligned: another copy path
])
def test_what_decides_the_checks_and_the_plan_is_in_the_key(array):
    assert key(array, StandIn(), StandIn()) != key()


def test_the_address_itself_is_not():
    assert key(StandIn(ptr=4096), StandIn(ptr=8192), StandIn()) == key()


def test_calls_that_make_no_key():
    assert key(np.zeros((1, 8, 2, 16), np.float16), StandIn(), StandIn()) is None  # no signature (NumPy)
    assert key(scalars=replaced(2, (-1,))) is not None  # a wrong window is its own key: the checks refuse it
    assert key(scalars=replaced(2, 5)) is None  # not a pair at all
    assert key(alibi_slopes=StandIn(shape=(2,))) is None  # ALiBi: always checked
    assert key(scalars=replaced(4, 0.1)) is None  # dropout: a seed per call


def test_an_unhashable_argument_is_looked_up_as_absent():
    list_window = key(scalars=replaced(2, [-1, -1]))
    table = {}
    assert _warm.lookup(table, list_window) is None
    _warm.remember(table, list_window, "entry")
    assert table == {}


def test_a_table_stops_growing_at_its_limit(monkeypatch):
    monkeypatch.setattr(_warm, "LIMIT", 3)
    table = {}
    for i in range(5):
        _warm.remember(table, key(scalars=replaced(1, 0.5 + i)), i)
    assert sorted(table.values()) == [0, 1, 2]


@pytest.mark.parametrize("given", [("q", "k_cache", "v_cache"), ("q", "k_cache", "v_cache", "cache_seqlens"),
                                   kvcache._ARRAY_ARGUMENTS])
def test_a_warm_kv_cache_call_launches_the_pointers_in_decode_pointers_order(given):
    """A warm KV-cache call picks its launch's pointers from the given arrays' (and out,
    lse and the workspace's) in the order _kernels.decode_pointers states."""
    class Launcher:
        class plan:
            workspace = ()

    class Calls:
        dtype = staticmethod(str)

    warm = kvcache._Warm(Launcher, Calls, 0, given, (1, 1, 1, 8), "float16", None)
    address = {name: 1000 + i for i, name in enumerate(kvcache._ARRAY_ARGUMENTS)}
    pointers = [0, *[1000 + i for i in warm.present], 7, 8, 9, 10]
    assert warm.order(pointers) == _kernels.decode_pointers({n: address[n] for n in given}, 7, 8, 9, 10)
