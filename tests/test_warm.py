"""Warm-call keys (cuflash/_warm.py) on the CPU: a stand-in array type whose library
reads a signature, as CuPy's and torch's do on the GPU, so that what makes two calls one
signature (and what does not) is checked everywhere; and, on a stand-in GPU, the functions
a warm call enters, counted: none of the checks, the planner, the compiler or the binding
(a training step through cuflash.torch too, on meta tensors: its allocations, launches and
driver calls counted as well); and the path of a cold call, from module to module, held short."""
import functools
import itertools
import os
import sys

import numpy as np
import pytest

import cuflash
from cuflash import _arrays, _compile, _device, _driver, _kernels, _warm, api, experiment, kvcache


class StandIn:
    def __init__(self, shape=(1, 8, 2, 16), strides=(512, 32, 16, 1), dtype="float16", ptr=256):
        self.shape, self.strides, self.dtype, self.ptr = shape, strides, dtype, ptr


class StandInCalls:
    @staticmethod
    def signature(x):
        return 0, x.shape, x.strides, x.dtype, x.ptr % 16 == 0

    @staticmethod
    def pointer(x):
        return x.ptr


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


# -- what a warm call enters, on a stand-in GPU ----------------------------------------------

class DeviceArray:
    """A CUDA array as cuflash sees one (its library's signature, pointer and allocation
    below); no memory behind it."""
    _next = 1 << 20

    def __init__(self, shape, dtype="float16"):
        self.shape, self.dtype = tuple(shape), dtype
        self.strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        self.ptr, DeviceArray._next = DeviceArray._next, DeviceArray._next + (1 << 20)


class DeviceCalls(StandInCalls):
    """The stand-in library's calls (as _arrays._CuPyCalls'), its allocations and launches
    counted, and the calls into the driver layer (``_driver``'s functions), by name."""
    array_type = DeviceArray

    def __init__(self):
        self.launches = self.allocations = 0
        self.driver = []

    @staticmethod
    def describe(x):
        """x as ``_arrays.inspect`` describes a CUDA array of device 0, or None for another."""
        if isinstance(x, DeviceArray):
            return _arrays.ArrayInfo(x, "cupy", x.ptr, x.shape, x.strides, x.dtype, 0)
        return None

    def driver_call(self, name: str, result):
        """A stand-in for ``_driver.<name>`` that returns ``result``, its calls recorded."""
        def call(*args):
            self.driver.append(name)
            return result
        return call

    @staticmethod
    def stream(device):
        return 7

    def empty(self, shape, dtype, device, zeros=False):
        self.allocations += 1
        return DeviceArray(shape, dtype)

    @staticmethod
    def dtype(name):
        return name

    def launch(self, function, x, y, z, bx, by, bz, shared, stream, arguments, extra):
        assert stream == 7
        self.launches += 1


class TensorCalls(DeviceCalls):
    """The stand-in library's calls on torch meta tensors (shapes, strides and dtypes, no
    memory), which stand for CUDA tensors of device 0; a tensor's address is its id."""

    def __init__(self):
        super().__init__()
        import torch
        self.torch, self.array_type = torch, torch.Tensor

    @staticmethod
    def signature(x):
        return x.device, x.shape, x.stride(), x.dtype, True

    @staticmethod
    def pointer(x):
        return id(x)

    @staticmethod
    def describe(x):
        if getattr(x, "is_meta", False):
            return _arrays.ArrayInfo(x, "cupy", id(x), tuple(x.shape), x.stride(), str(x.dtype).split(".")[-1], 0)
        return None

    def empty(self, shape, dtype, device, zeros=False):
        self.allocations += 1
        return self.torch.empty(shape, dtype=dtype, device="meta")

    def dtype(self, name):
        return getattr(self.torch, name)


def on_stand_in_gpu(monkeypatch, calls: DeviceCalls):
    """cuflash's calls on the arrays ``calls`` describes run as on an A100 (mma.sync
    kernels): planned, their kernels 'loaded' (never compiled; the compile layer's, once a
    kernel and process, as the device's facts are once a device: tests/test_device.py) and
    launched into calls.launches. Plans and warm tables start empty, and what the stand-in
    put in them is forgotten after the block this returns (experiment.override)."""
    real_inspect = _arrays.inspect

    def inspect(x, name):
        info = calls.describe(x)
        return real_inspect(x, name) if info is None else info

    monkeypatch.setattr(_arrays, "inspect", inspect)
    monkeypatch.setitem(_arrays._LIBRARIES, calls.array_type, calls)
    monkeypatch.setattr(_arrays, "cupy_calls", lambda: calls)
    monkeypatch.setattr(_device, "facts", lambda device: _device.Device("A100", (8, 0), 163 * 1024, 108, 12080))
    monkeypatch.setattr(_compile, "load_kernel", lambda kernel, device: 1)
    monkeypatch.setattr(_compile, "resident_ctas", lambda kernel, device: 2)
    monkeypatch.setattr(_driver, "primary_context", calls.driver_call("primary_context", 5))
    monkeypatch.setattr(_driver, "launcher", calls.driver_call("launcher", (calls.launch, lambda: 5)))
    monkeypatch.setattr(_driver, "zero_words", calls.driver_call("zero_words", None))
    return experiment.override()


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """DeviceArrays on the stand-in GPU (``on_stand_in_gpu``)."""
    calls = DeviceCalls()
    with on_stand_in_gpu(monkeypatch, calls):
        yield calls


@pytest.fixture
def stand_in_torch_gpu(monkeypatch):
    """torch meta tensors as CUDA tensors on the stand-in GPU (``on_stand_in_gpu``)."""
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    calls = TensorCalls()
    with on_stand_in_gpu(monkeypatch, calls):
        yield calls


COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def entered(call, *args, **kwargs) -> list[str]:
    """The names (module.function) of the cuflash functions call(*args, **kwargs) enters, in
    order, one per call."""
    package = os.path.dirname(cuflash.__file__) + os.sep
    names = []

    def profile(frame, event, arg):
        code = frame.f_code
        # (a comprehension is a frame of its own before Python 3.12: counted with its function)
        if event == "call" and code.co_filename.startswith(package) and code.co_name not in COMPREHENSIONS:
            module = frame.f_globals.get("__name__", "?").removeprefix("cuflash.")
            names.append(f"{module}.{code.co_qualname}")

    sys.setprofile(profile)
    try:
        call(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return names


# A warm call enters none of these: the checks, the planner, the compiler, the device's facts
# and the launcher's binding all ran on its signature's first call. (_options.has_mods reads
# whether a call has mods, and block_mask_mods a block mask's, which the key holds.)
WARM_TOO = ("_options.has_mods", "_options.block_mask_mods")
COLD_ONLY = ("_options.", "_plan.", "_compile.", "_device.", "_kernels.forward_launcher",
             "_kernels.backward_launcher", "_kernels.Launcher.__init__", "_kernels.Launcher._bind", "api._Warm",
             "api._inspect", "_arrays.Framework")


def shape(batch=2, seqlen=300, nheads=4, d=64):
    return batch, seqlen, nheads, d


def test_a_warm_forward_enters_only_the_key_the_lookup_and_the_launch(stand_in_gpu):
    """The second call of a signature (other arrays of the same layout) describes no array,
    checks and plans nothing and launches the first call's kernels: the functions it enters
    are this list, and a change that adds one to the warm path changes it."""
    def arrays():
        return [DeviceArray(shape()) for _ in "qkv"]

    cold = entered(cuflash.attention, *arrays(), causal=True, return_lse=True)
    assert "_plan.forward" in cold and "_options.check_qkv" in cold and "_kernels.forward_launcher" in cold
    launches = stand_in_gpu.launches
    assert launches >= 1
    warm = entered(cuflash.attention, *arrays(), causal=True, return_lse=True)
    assert stand_in_gpu.launches == 2 * launches  # the same kernels again
    assert not [name for name in warm if name.startswith(COLD_ONLY) and name not in WARM_TOO], warm
    assert warm == ["api.attention", "_options.has_mods", "api._key", "_warm.key",
                    "_arrays.signature", "_arrays.signature", "_arrays.signature", "_warm.lookup", "api._launch_warm",
                    "_kernels.Launcher.__call__", "_kernels.Launcher._launch", "_kernels.Launcher._launch_steps"]


def test_a_warm_backward_enters_only_the_key_the_lookup_and_the_launch(stand_in_gpu):
    """A warm backward, as the forward, describes no array and checks, plans and binds
    nothing: it allocates its gradients and scratch through its library's calls and
    launches the first call's kernels; the functions it enters are this list."""
    def arrays():  # dout, q, k, v, out, lse
        return [DeviceArray(shape()) for _ in range(5)] + [DeviceArray((2, 4, 300), "float32")]

    cold = entered(cuflash.attention_backward, *arrays(), causal=True)
    for name in ("_plan.backward", "_plan.mma_sync.backward_workspace", "_options.check_outputs",
                 "_kernels.backward_launcher"):
        assert name in cold, (name, cold)
    launches = stand_in_gpu.launches
    assert launches >= 2  # (the preprocess, then the backward's kernels)
    warm = entered(cuflash.attention_backward, *arrays(), causal=True)
    assert stand_in_gpu.launches == 2 * launches
    assert not [name for name in warm if name.startswith(COLD_ONLY) and name not in WARM_TOO], warm
    assert warm == ["api.attention_backward", "_options.has_mods", "api._key", "_warm.key",
                    *["_arrays.signature"] * 6, "_warm.lookup", "api._backward_warm", "_arrays.allocate_scratch",
                    "_kernels.Launcher.__call__", "_kernels.Launcher._launch", "_kernels.Launcher._launch_steps"]


def test_a_warm_backward_launches_what_the_cold_one_did(stand_in_gpu, monkeypatch):
    """The pointers a warm backward launches are the cold call's, in the same places:
    its arrays', dlse's (or 0), and its own gradients' and scratch's (fresh ones, as the
    cold call's are), with as many scratch buffers."""
    launched = []
    monkeypatch.setattr(_kernels.Launcher, "__call__", lambda self, stream, *pointers: launched.append(pointers))
    arrays = [DeviceArray(shape()) for _ in range(5)] + [DeviceArray((2, 4, 300), "float32")]
    for dlse in (None, DeviceArray((2, 4, 300), "float32")):
        for deterministic in (False, True):
            for _ in range(2):
                cuflash.attention_backward(*arrays, causal=True, deterministic=deterministic, dlse=dlse)
            cold, warm = launched[-2:]
            given = [a.ptr for a in arrays] + [0 if dlse is None else dlse.ptr]
            assert list(cold[:7]) == list(warm[:7]) == given
            assert len(cold) == len(warm) == 13
            assert [p == 0 for p in cold[7:]] == [p == 0 for p in warm[7:]]
            assert not (set(warm[7:]) - {0}) & set(cold[7:])  # (its own allocations)


LAUNCH = ["_kernels.Launcher.__call__", "_kernels.Launcher._launch", "_kernels.Launcher._launch_steps"]


def training_step(return_lse=False, dout_strides=None):
    """A training step through cuflash.torch on meta tensors (the stand-in GPU's arrays): the
    forward of q, k and v, which require grad, and their gradients through autograd (on
    this thread: meta tensors have no device thread); with ``return_lse``, lse's gradient
    too. ``dout_strides``: the layout of out's gradient (contiguous by default)."""
    import torch

    import cuflash.torch
    q, k, v = (torch.empty(shape(), dtype=torch.float16, device="meta", requires_grad=True) for _ in "qkv")
    dout = torch.empty_strided(shape(), dout_strides or (300 * 4 * 64, 4 * 64, 64, 1), dtype=torch.float16,
                               device="meta")
    dlse = torch.empty((2, 4, 300), dtype=torch.float32, device="meta")

    def step():
        result = cuflash.torch.attention(q, k, v, causal=True, return_lse=return_lse)
        return torch.autograd.grad(result, (q, k, v), (dout, dlse) if return_lse else dout)

    return step


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_warm_training_step_enters_only_its_step_the_lookup_and_the_launches(stand_in_torch_gpu, return_lse):
    """A training step through cuflash.torch on a signature that ran: its forward reads the
    signatures of q, k and v, its backward those of dout (and dlse) alone (q, k, v, out and
    lse are the forward's), and neither checks, plans nor describes an array. The functions
    it enters are this list, its allocations out, lse, dq, dk, dv and one scratch buffer,
    its launches the first step's: a change that adds a call, an allocation, a launch or a
    driver call to the step shows here."""
    calls, step = stand_in_torch_gpu, training_step(return_lse)
    cold = entered(step)
    for name in ("_options.check_qkv", "_plan.forward", "_plan.backward", "torch.calls._op_options"):
        assert name in cold, (name, cold)
    launches, allocations, driver = calls.launches, calls.allocations, len(calls.driver)
    assert launches == 4  # (the forward, then the backward's preprocess, kernel and dQ's conversion)
    warm = entered(step)
    assert calls.launches - launches == launches
    assert calls.allocations - allocations == 6
    assert calls.driver[driver:] == ["launcher"] * 2  # (the launch's handles, as each launcher launches)
    assert not [name for name in warm if name.startswith(COLD_ONLY) and name not in WARM_TOO], warm
    dlse = ["_arrays.signature"] if return_lse else []
    assert warm == ["torch.calls.attention", "_options.has_mods", "torch.calls._tracked", "api._key", "_warm.key",
                    *["_arrays.signature"] * 3, "_warm.lookup", "torch.calls._Steps.forward", "api._launch_warm",
                    *LAUNCH, "torch.calls._Steps.backward", "torch.calls._output_gradients", "_arrays.signature",
                    *dlse, "api._backward_warm", "_arrays.allocate_scratch", *LAUNCH]


def test_a_warm_training_step_launches_what_the_cold_one_did(stand_in_torch_gpu, monkeypatch):
    """A warm step launches the first step's launchers (the ones cuflash.attention and
    attention_backward made for the same arrays and options) with its arrays' pointers in
    the same places, its own outputs and scratch laid out alike; out's gradient in another
    layout is another backward, planned once."""
    launched = []
    monkeypatch.setattr(_kernels.Launcher, "__call__", lambda self, stream, *pointers: launched.append((self,
                                                                                                        pointers)))
    step = training_step()
    for _ in range(2):
        step()
    (forward, cold_forward), (backward, cold_backward), (warm_forward, warm), (warm_backward, warm_grads) = launched
    assert warm_forward is forward and warm_backward is backward
    assert cold_forward[:3] == warm[:3] and cold_backward[:4] == warm_grads[:4]  # (q, k, v; dout, q, k, v)
    for cold, warm in ((cold_forward, warm), (cold_backward, warm_grads)):
        assert len(cold) == len(warm) and [p == 0 for p in cold] == [p == 0 for p in warm]
    delta, dq_accum, semaphore = warm_grads[-3:]
    assert semaphore == 0 and dq_accum - delta == cold_backward[-2] - cold_backward[-3] > 0
    other = training_step(dout_strides=(300 * 4 * 64, 64, 300 * 64, 1))  # (dout as (batch, nheads, seqlen, d))
    assert "_plan.backward" in entered(other) and "_plan.backward" not in entered(other)
    assert launched[-1][0] is launched[-3][0] is not backward


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_training_step_computes_what_the_general_path_does(monkeypatch, return_lse, deterministic):
    """CPU tensors take a training step's path too once torch tensors have a signature (as
    after a call on CUDA tensors): its outputs and gradients are the general path's, bit
    for bit, with each option a step carries and out's gradient in two layouts."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cuflash.torch
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 11, 2, 16, generator=generator, dtype=torch.float64) for _ in "kv")
    douts = (torch.randn(q.shape, generator=generator, dtype=torch.float64),
             torch.randn(2, 4, 9, 16, generator=generator, dtype=torch.float64).transpose(1, 2))
    dlse = torch.randn(2, 4, 9, generator=generator, dtype=torch.float64).float()
    options = dict(causal=True, softmax_scale=0.3, window_size=(5, 1), softcap=4.0, deterministic=deterministic,
                   return_lse=return_lse)

    def steps():
        results = []
        for dout in douts:
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            outputs = cuflash.torch.attention(*leaves, **options)
            outputs = outputs if return_lse else (outputs,)
            grads = torch.autograd.grad(outputs, leaves, (dout, dlse)[:len(outputs)])
            results.append((type(outputs[0].grad_fn).__name__, *outputs, *grads))
        return results

    monkeypatch.delitem(_arrays._LIBRARIES, torch.Tensor, raising=False)
    general = steps()
    monkeypatch.setitem(_arrays._LIBRARIES, torch.Tensor, TensorCalls())
    stepped = steps()
    for (general_path, *expected), (path, *got) in zip(general, stepped):
        assert general_path != path == "_StepsBackward"
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("options", [dict(dropout_p=0.2), dict(dropout_p=0.2, seed=5), dict(seed=5)])
def test_a_training_call_with_dropout_or_a_seed_takes_the_general_path(monkeypatch, options):
    """Dropout draws its seed and offset a call, and the backward needs them: such calls
    (and those with a seed) never take a step's path, cold or warm."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cuflash.torch
    monkeypatch.setitem(_arrays._LIBRARIES, torch.Tensor, TensorCalls())
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    for _ in range(2):
        out = cuflash.torch.attention(q, k, v, causal=True, **options)
        assert type(out.grad_fn).__name__ != "_StepsBackward"


def test_a_warm_kv_cache_call_enters_no_check_plan_or_compile(stand_in_gpu):
    """A warm KV-cache call (decode: host time is most of a step) checks, describes and
    plans nothing: the functions it enters are this list."""
    k_cache, v_cache = DeviceArray((2, 256, 2, 64)), DeviceArray((2, 256, 2, 64))
    call = functools.partial(cuflash.attention_with_kvcache, k_cache=k_cache, v_cache=v_cache, cache_seqlens=200,
                             causal=True, return_lse=True)
    cold = entered(call, DeviceArray((2, 1, 4, 64)))
    for name in ("_plan.decoding.decode", "_options.kvcache", "_kernels.decode_launcher"):
        assert name in cold, (name, cold)
    launches = stand_in_gpu.launches
    assert launches >= 1
    warm = entered(call, DeviceArray((2, 1, 4, 64)))
    assert stand_in_gpu.launches == 2 * launches
    assert not [name for name in warm if name.startswith(COLD_ONLY) and name not in WARM_TOO], warm
    assert warm == ["kvcache.attention_with_kvcache", "_options.has_mods", "kvcache._attention_with_kvcache",
                    "kvcache._key", "_warm.key", *["_arrays.signature"] * 3, "_warm.lookup", "kvcache._decode_warm",
                    "_kernels.Launcher.__call__", "_kernels.Launcher._launch", "_kernels.Launcher._launch_steps"]


# -- the path of a cold call, on a stand-in GPU -----------------------------------------------

def path(names: list[str]) -> tuple[set[str], list[str]]:
    """The modules of the package that the functions ``names`` lie in (the planner's package
    as one), and the order the path visits them in: one entry a visit."""
    modules = [name.split(".")[0] for name in names]
    return set(modules), [module for module, _ in itertools.groupby(modules)]


def test_a_cold_forward_takes_a_short_path(stand_in_gpu):
    """Following q from cuflash.attention on its signature's first call: it is checked
    (_options), planned (_plan, the device's facts given as one value, the plan final as it
    leaves), bound and launched (_kernels), its arrays described and allocated (_arrays),
    and its signature looked up and kept (_warm). The modules it enters, the moves between
    them and its calls into the driver layer are held at these counts at most: a change
    that adds to them shows here."""
    cold = entered(cuflash.attention, *[DeviceArray(shape()) for _ in "qkv"], causal=True, return_lse=True)
    modules, visits = path(cold)
    assert modules <= {"api", "_options", "_warm", "_arrays", "_plan", "_kernels"}, visits
    assert len(visits) - 1 <= 20, visits
    # (the context the launcher binds in, the launch's calls)
    assert len(stand_in_gpu.driver) <= 2, stand_in_gpu.driver


def test_a_cold_backward_takes_a_short_path(stand_in_gpu):
    """The same of attention_backward's first call of a signature (its workspace and its
    plan's three kernels)."""
    arrays = [DeviceArray(shape()) for _ in range(5)] + [DeviceArray((2, 4, 300), "float32")]
    cold = entered(cuflash.attention_backward, *arrays, causal=True)
    modules, visits = path(cold)
    assert modules <= {"api", "_options", "_warm", "_arrays", "_plan", "_kernels"}, visits
    assert len(visits) - 1 <= 29, visits
    assert len(stand_in_gpu.driver) <= 2, stand_in_gpu.driver


# -- calls with score_mod / mask_mod -------------------------------------------------------------

OFFSET = 0  # (read by shifted_mask: a global a trace reads)


def shifted_mask(b, h, q_idx, kv_idx, *tensors):
    return kv_idx <= q_idx + OFFSET


def head_bias(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h]


def test_a_mods_key_holds_the_functions_what_they_read_and_the_tensors_addresses(monkeypatch):
    """Two calls with the same functions, reading the same globals and closure values, and the
    same mod tensors (same signature and address: the kernels' parameters hold it) are one
    key; another address, a changed global or closure value, another function is another."""
    def mods_key(score_mod=head_bias, mask_mod=shifted_mask, tensors=(StandIn((4,), (1,), "float32", 4096),)):
        return _warm.mods_key(key(), score_mod, mask_mod, tensors, None)

    assert mods_key() == mods_key() and hash(mods_key()) == hash(mods_key())
    assert mods_key(tensors=(StandIn((4,), (1,), "float32", 8192),)) != mods_key()
    assert mods_key(mask_mod=None) != mods_key()
    before = mods_key()
    monkeypatch.setitem(globals(), "OFFSET", 3)
    assert mods_key() != before
    monkeypatch.setitem(globals(), "OFFSET", 0.0)  # (equal, but another constant in the trace)
    assert mods_key() != before

    def window(width):
        return lambda b, h, q_idx, kv_idx: q_idx - kv_idx < width

    assert _warm.mods_key(key(), None, window(4), (), None) != _warm.mods_key(key(), None, window(8), (), None)
    assert _warm.mods_key(key(), None, window(4), (), None) == _warm.mods_key(key(), None, window(4), (), None)


def test_calls_with_mods_that_make_no_key():
    """A callable that is no plain function (its state unseen), a mod tensor without a
    signature (NumPy) or a call without a key make none: such calls are traced and planned
    each time."""
    class Mask:
        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    assert _warm.mods_key(key(), None, Mask(), (), None) is None
    assert _warm.mods_key(key(), None, functools.partial(shifted_mask), (), None) is None
    assert _warm.mods_key(key(), head_bias, None, (np.zeros(4, np.float32),), None) is None
    assert _warm.mods_key(None, None, shifted_mask, (), None) is None
    assert _warm.mods_key(key(), None, shifted_mask, "not a tuple", None) is None


def test_a_warm_call_with_mods_traces_checks_and_plans_nothing(stand_in_gpu):
    """The second forward and backward with the same score_mod, mask_mod and mod tensor
    neither trace the functions again nor check or plan: they enter these lists. A global
    that the mask reads, changed, makes the next call trace it again."""
    bias = DeviceArray((4,), "float32")
    mods = dict(score_mod=head_bias, mask_mod=shifted_mask, mod_tensors=(bias,))

    def forward():
        return entered(cuflash.attention, *[DeviceArray(shape()) for _ in "qkv"], return_lse=True, **mods)

    def backward():
        arrays = [DeviceArray(shape()) for _ in range(5)] + [DeviceArray((2, 4, 300), "float32")]
        return entered(cuflash.attention_backward, *arrays, **mods)

    for call, first, launch in ((forward, "api.attention", "api._launch_warm"),
                                (backward, "api.attention_backward", "api._backward_warm")):
        cold = call()
        assert "mod.trace" in cold and "_options.check_mods" in cold
        launches = stand_in_gpu.launches
        warm = call()
        assert stand_in_gpu.launches > launches
        assert not [name for name in warm if name.startswith(COLD_ONLY) and name not in WARM_TOO], warm
        signatures = ["_arrays.signature"] * (3 if call is forward else 6)
        scratch = [] if call is forward else ["_arrays.allocate_scratch"]
        assert warm == [first, "_options.has_mods", "api._key", "_warm.key", *signatures, "_warm.mods_key",
                        "mod.watched", "mod.watched", "_arrays.signature", "_arrays.library", "_warm.lookup", launch,
                        *scratch, *LAUNCH]
    global OFFSET
    OFFSET = 2
    try:
        assert "mod.trace" in forward()
    finally:
        OFFSET = 0


def test_a_warm_call_with_a_block_mask_traces_nothing(stand_in_gpu):
    """With a block mask (the mask and its statuses carried), as without."""
    statuses = DeviceArray((1, 1, 3, 3), "int8")
    from cuflash import mod
    blocks = mod.BlockMask(shifted_mask, (), mod.trace(shifted_mask, "mask"), statuses, None, None, 300, 300)
    for _ in range(2):
        names = entered(cuflash.attention, *[DeviceArray(shape()) for _ in "qkv"], block_mask=blocks)
    assert not [name for name in names if name.startswith(COLD_ONLY + ("mod.trace",)) and name not in WARM_TOO]
    other = mod.BlockMask(shifted_mask, (), blocks.tree, DeviceArray((1, 1, 3, 3), "int8"), None, None, 300, 300)
    assert "mod.trace" in entered(cuflash.attention, *[DeviceArray(shape()) for _ in "qkv"], block_mask=other)
