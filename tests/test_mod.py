"""Programmable attention on the NumPy path and its tracer, cuflash.mod.

Random expression trees traced and evaluated against NumPy running the same function
directly; the derivative against finite differences; softcap, ALiBi, causal and windows
re-expressed as score_mod / mask_mod against the built-in options (the CPU path and the
float64 oracle: outputs, LSE and gradients); document, prefix-LM and relative-bias masks
against a dense computation written out here; every tracing error, naming the function;
the CUDA printer's text through NVRTC."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _options, cpu, mod
from cuflash.mod import derivative, to_cuda, to_numpy, trace
from cuflash.reference import (attention_reference, attention_reference_backward, attention_reference_varlen,
                               attention_reference_varlen_backward)
from .strategies import NO_INVALID_ARITHMETIC, assert_close, assert_lse_close, finite_difference

pytestmark = NO_INVALID_ARITHMETIC  # (strategies.py)

INF = float("inf")

# -- random expression trees ------------------------------------------------------------------------
#
# A recipe is a nested tuple; `build` turns it into the same computation twice: on the tracer's
# symbols with cuflash.mod's functions, and on NumPy arrays with NumPy's.

TABLE = np.random.default_rng(7).standard_normal((3, 7))            # float64 (nheads, 7)
INT_TABLE = np.random.default_rng(8).integers(-5, 6, size=(2, 6))   # int64 (batch, 6)
FLAGS = np.array([True, False, True, True, False])
TENSORS = (TABLE, INT_TABLE, FLAGS)

SYMBOLIC = mod
NUMERIC = type("numeric", (), dict(
    exp=staticmethod(np.exp), log=staticmethod(np.log), tanh=staticmethod(np.tanh), sqrt=staticmethod(np.sqrt),
    abs=staticmethod(np.abs), sigmoid=staticmethod(lambda x: 1 / (1 + np.exp(-x))), minimum=staticmethod(np.fmin),
    maximum=staticmethod(np.fmax), where=staticmethod(np.where)))

FLOAT_CONSTANTS = st.sampled_from([-3.5, -1.0, -0.25, 0.5, 1.0, 2.0, 7.0]) | st.floats(0.1, 10) | st.floats(-10, -0.1)
INT_CONSTANTS = st.integers(-6, 6)
DIVISORS = st.sampled_from([-3, -1, 2, 3, 5])


@st.composite
def recipes(draw, type, depth=4, score=True):
    """A recipe of the given result type ("float", "int" or "bool"); a mask's (``score``
    False) reads no score."""

    def sub(of):  # a sub-recipe of type `of` ("number": float or int)
        if of == "number":
            of = draw(st.sampled_from(["float", "int"]))
        return draw(recipes(of, depth - 1, score))

    def pick(*options):
        return draw(st.sampled_from(options))

    if depth == 0 or draw(st.integers(0, 4)) == 0:
        if type == "float":
            variables = [("score",)] if score else [("table", ("q",)), ("cast", ("k",))]
            return draw(st.sampled_from(variables) | st.tuples(st.just("const"), FLOAT_CONSTANTS))
        if type == "int":
            return draw(st.sampled_from([("b",), ("h",), ("q",), ("k",)]) | st.tuples(st.just("const"), INT_CONSTANTS))
        return draw(st.tuples(st.just("const"), st.booleans()))
    if type == "float":
        kind = pick("binary", "unary", "pow", "where", "table", "cast", "extremum")
        if kind == "binary":
            return (pick("+", "-", "*", "/"), sub("number"), sub("float"))
        if kind == "unary":
            return (pick("neg", "abs", "exp", "log", "tanh", "sqrt", "sigmoid"), sub("float"))
        if kind == "pow":
            return ("pow", sub("float"), pick(0, 1, 2, 3, 0.5, -1.5, 2.5))
        if kind == "where":
            return ("where", sub("bool"), sub("float"), sub("number"))
        if kind in ("table", "cast"):
            return (kind, sub("int"))
        return (pick("minimum", "maximum"), sub("float"), sub("number"))
    if type == "int":
        kind = pick("binary", "floor", "unary", "where", "table", "extremum")
        if kind == "binary":
            return (pick("+", "-", "*"), sub("int"), sub("int"))
        if kind == "floor":
            return (pick("//", "%"), sub("int"), ("const", draw(DIVISORS)))
        if kind == "unary":
            return (pick("neg", "abs"), sub("int"))
        if kind == "where":
            return ("where", sub("bool"), sub("int"), sub("int"))
        if kind == "table":
            return ("int_table", sub("int"))
        return (pick("minimum", "maximum"), sub("int"), sub("int"))
    kind = pick("compare", "compare", "logic", "not", "flag")
    if kind == "compare":
        return (pick("<", "<=", ">", ">=", "==", "!="), sub("number"), sub("number"))
    if kind == "logic":
        return (pick("&", "|"), sub("bool"), sub("bool"))
    if kind == "not":
        return ("~", sub("bool"))
    return ("flag", sub("int"))


BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b,
          "//": lambda a, b: a // b, "%": lambda a, b: a % b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
          ">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
          "&": lambda a, b: a & b, "|": lambda a, b: a | b}


def build(recipe, env, lib):
    """The recipe's value over env (score, b, h, q, k and the tensors), with lib's functions."""
    op, *parts = recipe
    if op in ("score", "b", "h", "q", "k"):
        return env[op]
    if op == "const":
        return parts[0]
    if op == "pow":
        base = build(parts[0], env, lib)
        if isinstance(base, (int, float)):  # (Python's ** gives a complex for a negative base)
            base = np.float64(base)
        return base ** parts[1]
    args = [build(p, env, lib) for p in parts]
    if op == "/" and all(isinstance(a, (int, float)) for a in args):  # (Python's 1 / 0 raises)
        return np.float64(args[0]) / args[1]
    if op in BINARY:
        return BINARY[op](*args)
    if op == "neg":
        return -args[0]
    if op == "~":
        return (not args[0]) if isinstance(args[0], bool) else ~args[0]
    if op == "cast":
        return args[0] + 0.0
    if op == "table":
        return env["table"][env["h"], args[0] % 7]
    if op == "int_table":
        return env["int_table"][env["b"], args[0] % 6]
    if op == "flag":
        return env["flags"][args[0] % 5]
    return getattr(lib, op)(*args)


def _function(recipe, kind):
    """The recipe as a score_mod (its value plus 0 * score: always a float) or a mask_mod."""
    if kind == "score":
        def score_mod(score, b, h, q, k, table, int_table, flags):
            env = dict(score=score, b=b, h=h, q=q, k=k, table=table, int_table=int_table, flags=flags)
            lib = SYMBOLIC if isinstance(score, mod.Sym) else NUMERIC
            return build(recipe, env, lib) + score * 0.0
        return score_mod

    def mask_mod(b, h, q, k, table, int_table, flags):
        env = dict(b=b, h=h, q=q, k=k, table=table, int_table=int_table, flags=flags)
        lib = SYMBOLIC if isinstance(b, mod.Sym) else NUMERIC
        return build(recipe, env, lib) | (q < 0)
    return mask_mod


def _grid(seed=0):
    """score (2, 3, 4, 5) and broadcasting index arrays b, h, q, k."""
    rng = np.random.default_rng(seed)
    score = rng.standard_normal((2, 3, 4, 5)) * 3
    b, h, q, k = np.arange(2)[:, None, None, None], np.arange(3)[:, None, None], np.arange(4)[:, None], np.arange(5)
    return score, b, h, q, k


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["score", "mask"]), root=st.sampled_from(["float", "float", "int", "bool"]),
       data=st.data())
def test_random_trees_evaluate_as_numpy_does(kind, root, data):
    """A score tree's root of any type (the score_mod adds 0 * score), a mask tree's boolean."""
    recipe = data.draw(recipes(root, score=True) if kind == "score" else recipes("bool", score=False),
                       label="recipe")
    fn = _function(recipe, kind)
    with np.errstate(all="ignore"):  # (the recipe's constant parts run in Python while tracing)
        tree = trace(fn, kind, TENSORS)
        again = trace(fn, kind, TENSORS)
    score, b, h, q, k = _grid()
    indices = (b, h, q, k)
    with np.errstate(all="ignore"):
        expected = fn(score, *indices, *TENSORS) if kind == "score" else fn(*indices, *TENSORS)
    args = ((score,) if kind == "score" else ()) + indices + TENSORS
    got = to_numpy(tree)(*args, dtype=np.float64)
    shape = np.broadcast_shapes(score.shape, np.shape(got), np.shape(expected))
    got, expected = np.broadcast_to(got, shape), np.broadcast_to(expected, shape)
    assert got.dtype == (np.float64 if kind == "score" else np.bool_)
    if kind == "mask":
        np.testing.assert_array_equal(got, expected)
    else:
        assert_close(got, expected, atol=0, rtol=1e-13, name=tree.text)
    # One canonical tree: tracing again gives an equal tree with the same text and hash.
    assert again == tree and hash(again.root) == hash(tree.root) and again.text == tree.text


@settings(max_examples=150, deadline=None)
@given(recipe=recipes("float"))
def test_random_derivatives_match_finite_differences(recipe):
    fn = _function(recipe, "score")
    with np.errstate(all="ignore"):
        tree = trace(fn, "score", TENSORS)
    f, gradient = to_numpy(tree), to_numpy(derivative(tree))
    score, b, h, q, k = _grid(1)
    step = 1e-5 * (1 + np.abs(score))

    def at(s):
        return np.broadcast_to(f(s, b, h, q, k, *TENSORS), score.shape)

    with np.errstate(all="ignore"):  # (inf - inf where the function overflows)
        wide = (at(score + step) - at(score - step)) / (2 * step)
        narrow = (at(score + step / 2) - at(score - step / 2)) / step
        value = at(score)
        d = np.broadcast_to(gradient(score, b, h, q, k, *TENSORS), score.shape)
        _check_derivative(tree, score, value, wide, narrow, d)


def _check_derivative(tree, score, value, wide, narrow, d):
    # Where halving the step barely moves the difference quotient, f is smooth there and the
    # quotient is close to the derivative (a kink or a step near the point moves it). The
    # chain rule gives NaN where it meets 0 / 0 (sqrt(minimum(score, 0)) at score > 0), as
    # autograd does: only finite derivatives are compared.
    scale = 1 + np.abs(narrow) + 1e-6 * np.abs(value)
    smooth = np.isfinite(wide) & np.isfinite(narrow) & np.isfinite(value) & (np.abs(wide - narrow) <= 1e-6 * scale)
    smooth &= np.isfinite(d)
    bad = smooth & ~(np.abs(d - narrow) <= 1e-4 * scale)
    assert not bad.any(), (f"{tree.text}: d/dscore {d[bad][:3]}, finite differences {narrow[bad][:3]} "
                           f"at score {score[bad][:3]}")


@pytest.mark.parametrize("fn,formula", [
    (lambda s, b, h, q, k: mod.exp(s), lambda s: np.exp(s)),
    (lambda s, b, h, q, k: mod.log(s), lambda s: 1 / s),
    (lambda s, b, h, q, k: mod.tanh(s / 3) * 3, lambda s: 1 - np.tanh(s / 3) ** 2),
    (lambda s, b, h, q, k: mod.sqrt(s), lambda s: 0.5 / np.sqrt(s)),
    (lambda s, b, h, q, k: mod.sigmoid(s), lambda s: np.exp(-s) / (1 + np.exp(-s)) ** 2),
    (lambda s, b, h, q, k: s ** 3 - 2 * s ** 0.5, lambda s: 3 * s ** 2 - s ** -0.5),
    (lambda s, b, h, q, k: s ** 0 + s ** 1, lambda s: np.ones_like(s)),
    (lambda s, b, h, q, k: 1 / s - s / 4, lambda s: -1 / s ** 2 - 0.25),
    (lambda s, b, h, q, k: abs(s - 1.5), lambda s: np.sign(s - 1.5)),
    (lambda s, b, h, q, k: mod.minimum(s, 1.2) + mod.maximum(2 * s, 3.0), lambda s: (s < 1.2) + 2.0 * (s > 1.5)),
    (lambda s, b, h, q, k: mod.where(s > q, s * s, -s), lambda s: np.where(s > np.arange(3)[:, None], 2 * s, -1.0)),
    (lambda s, b, h, q, k: s * (q - k) + (q // 2) * 1.5, lambda s: (np.arange(3)[:, None] - np.arange(4)) + 0 * s),
    (lambda s, b, h, q, k: -(s * mod.exp(-s)), lambda s: (s - 1) * np.exp(-s)),
])
def test_derivative_of_each_operation(fn, formula):
    s = np.linspace(0.3, 2.9, 12).reshape(3, 4)
    q, k = np.arange(3)[:, None], np.arange(4)
    got = to_numpy(derivative(trace(fn)))(s, 0, 0, q, k)
    assert_close(np.broadcast_to(got, s.shape), formula(s), atol=1e-12, rtol=1e-12)


def test_derivative_simplifies_and_is_a_score_tree():
    tree = trace(lambda s, b, h, q, k, t: s + t[h] * q, "score", (np.ones(2, np.float32),))
    d = derivative(tree)
    assert d.kind == "score" and d.text == "1.0" and d.tensors == tree.tensors
    assert derivative(trace(lambda s, b, h, q, k: 5 * mod.tanh(s / 5))).text == \
        "mul(5.0, mul(sub(1.0, mul(tanh(div(score, 5.0)), tanh(div(score, 5.0)))), 0.2))"
    with pytest.raises(ValueError, match="derivative takes a score_mod's tree"):
        derivative(trace(lambda b, h, q, k: q < k, "mask"))


def test_canonical_text_and_immutability():
    slopes = np.ones(4, np.float32)
    tree = trace(lambda s, b, h, q, k, slopes: s - slopes[h] * abs(q - k + 3), "score", (slopes,))
    assert tree.text == "sub(score, mul(t0:float32[h], float(abs(add(sub(q_idx, kv_idx), 3)))))"
    assert str(tree) == tree.text and tree.tensors[0].name == "slopes"
    with pytest.raises(AttributeError):
        tree.root.op = "add"
    # 0.0 and -0.0 are different constants; equal trees are equal whatever the parameter names.
    assert trace(lambda s, b, h, q, k: s + 0.0) != trace(lambda s, b, h, q, k: s + -0.0)
    assert trace(lambda x, y, z, u, w: x * 2).root == trace(lambda s, b, h, q, k: s * 2.0).root
    mask = trace(lambda b, h, q, k: (q >= k) & ~(b == 1) | (h != 0), "mask")
    assert mask.text == "or(and(ge(q_idx, kv_idx), not(eq(b, 1))), ne(h, 0))"


def test_numpy_functions_and_constants_on_symbols():
    tree = trace(lambda s, b, h, q, k: np.exp(s) + np.float32(2) * np.maximum(s, q) + np.where(q > k, 1.0, s))
    assert tree.text == "add(add(exp(score), mul(2.0, max(score, float(q_idx)))), where(gt(q_idx, kv_idx), 1.0, score))"
    assert mod.exp(0.0) == 1.0 and mod.minimum(2, 3) == 2 and mod.where(False, 1, 2) == 2 and mod.abs(-2) == 2


def test_float32_evaluation_stays_float32():
    f = to_numpy(trace(lambda s, b, h, q, k, t: s * 0.1 + t[h] + q / 3, "score", (np.ones(2, np.float64),)))
    s = np.ones((2, 3, 4), np.float32)
    out = f(s, 0, np.arange(2)[:, None, None], np.arange(3)[:, None], np.arange(4), np.ones(2))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.float32(1) * np.float32(0.1) + np.float32(1)
                                  + (np.arange(3)[:, None] / 3).astype(np.float32) + 0 * s)


# -- attention: the built-ins as mods ------------------------------------------------------------------

@st.composite
def problems(draw, *, varlen=False):
    """Tiny dense problems: (batch, seqlen_q, seqlen_k, nheads, nheads_kv, d), a dtype and blocks."""
    nheads_kv = draw(st.integers(1, 2))
    return dict(batch=draw(st.integers(1, 2)), seqlen_q=draw(st.integers(1, 9)), seqlen_k=draw(st.integers(1, 9)),
                nheads=nheads_kv * draw(st.integers(1, 2)), nheads_kv=nheads_kv, d=draw(st.sampled_from([1, 3, 8])),
                dtype=draw(st.sampled_from([np.float32, np.float64])), block_q=draw(st.integers(1, 5)),
                block_k=draw(st.integers(1, 5)), seed=draw(st.integers(0, 2**32 - 1)))


def _inputs(p, rng=None):
    rng = np.random.default_rng(p["seed"]) if rng is None else rng
    q = rng.standard_normal((p["batch"], p["seqlen_q"], p["nheads"], p["d"])).astype(p["dtype"])
    k, v = (rng.standard_normal((p["batch"], p["seqlen_k"], p["nheads_kv"], p["d"])).astype(p["dtype"])
            for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(p["dtype"])
    return q, k, v, dout


def _window_mask(diagonal, left, right):
    """The window as a mask_mod (-1: that side unbounded)."""
    def window(b, h, q, k):
        visible = (k >= 0) if left < 0 else (k >= q + diagonal - left)
        return visible if right < 0 else visible & (k <= q + diagonal + right)
    return window


@st.composite
def builtin_cases(draw):
    """(p, built-in options, the same as mods, mod_tensors, extra options for both)."""
    p = draw(problems())
    sq, sk = p["seqlen_q"], p["seqlen_k"]
    diagonal = sk - sq
    rng = np.random.default_rng(p["seed"] + 1)
    builtin, mods, extra = {}, {}, {}
    which = draw(st.sampled_from(["softcap", "alibi", "alibi_batch", "causal", "window", "softcap+causal_mod",
                                  "alibi_mod+softcap", "causal_mod+dropout", "window_mod+alibi"]))
    slopes = rng.random(p["nheads"]).astype(np.float32)
    batch_slopes = rng.random((p["batch"], p["nheads"])).astype(np.float32)
    left, right = draw(st.integers(-1, sk)), draw(st.integers(-1, sk))
    if "softcap" in which:
        if which == "softcap":
            builtin["softcap"], mods["score_mod"] = 5.0, lambda s, b, h, q, k: 5 * mod.tanh(s / 5)
        else:
            extra["softcap"] = 0.7
    if which in ("alibi", "alibi_mod+softcap"):
        builtin["alibi_slopes"] = slopes
        mods["score_mod"] = lambda s, b, h, q, k, slopes: s - slopes[h] * abs(q - k + diagonal)
        mods["mod_tensors"] = (slopes,)
    if which == "alibi_batch":
        builtin["alibi_slopes"] = batch_slopes
        mods["score_mod"] = lambda s, b, h, q, k, slopes: s - slopes[b, h] * abs(q - k + diagonal)
        mods["mod_tensors"] = (batch_slopes,)
    if which in ("causal", "softcap+causal_mod", "causal_mod+dropout"):
        builtin["causal"], mods["mask_mod"] = True, lambda b, h, q, k: k <= q + diagonal
    if which == "window" or which == "window_mod+alibi":
        builtin["window_size"] = (left, right)
        norm = [-1 if w < 0 or w >= sk else w for w in (left, right)]
        mods["mask_mod"] = _window_mask(diagonal, *norm)
    if which == "window_mod+alibi":
        extra["alibi_slopes"] = slopes
    if which == "causal_mod+dropout":
        extra.update(dropout_p=0.3, seed=draw(st.integers(0, 2**64 - 1)))
    return p, builtin, mods, extra


TOLERANCE = {np.float32: 2e-6, np.float64: 1e-12}
API_GRAD_TOLERANCE = {np.float32: 2e-4, np.float64: 1e-5}


@settings(max_examples=60, deadline=None)
@given(case=builtin_cases())
def test_builtins_as_mods_on_the_cpu_path(case):
    p, builtin, mods, extra = case
    q, k, v, dout = _inputs(p)
    blocks = dict(block_q=p["block_q"], block_k=p["block_k"])
    scale = dict(causal=False, softmax_scale=None)
    want_out, want_lse = cpu.attention_forward(q, k, v, **{**scale, **builtin, **extra}, **blocks)
    got_out, got_lse = cpu.attention_forward(q, k, v, **scale, **mods, **extra, **blocks)
    tol = TOLERANCE[p["dtype"]]
    assert_close(got_out, want_out, atol=tol, name="out")
    assert_close(got_lse, want_lse, atol=tol * 10, rtol=tol, name="lse")
    dlse = np.random.default_rng(p["seed"] + 2).standard_normal(want_lse.shape).astype(np.float32)
    dlse = np.where(np.isinf(want_lse), np.float32(np.nan), dlse)  # (ignored where no key is seen)
    want = cpu.attention_backward(dout, q, k, v, want_out, want_lse, dlse=dlse, **{**scale, **builtin, **extra},
                                  **blocks)
    got = cpu.attention_backward(dout, q, k, v, want_out, want_lse, dlse=dlse, **scale, **mods, **extra, **blocks)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, atol=tol * 10, name=name)


@settings(max_examples=40, deadline=None)
@given(case=builtin_cases())
def test_builtins_as_mods_in_the_oracle_and_through_the_api(case):
    p, builtin, mods, extra = case
    if "dropout_p" in extra:  # (the oracle takes dropout's keep mask instead)
        keep = cuflash._philox.keep_mask(extra["seed"], 0, p["batch"], p["nheads"], p["seqlen_q"], p["seqlen_k"],
                                         extra["dropout_p"])
        oracle_extra = dict(dropout_p=extra["dropout_p"], dropout_keep=keep)
    else:
        oracle_extra = extra
    q, k, v, dout = _inputs(p)
    want_out, want_lse = attention_reference(q, k, v, **builtin, **oracle_extra)
    got_out, got_lse = attention_reference(q, k, v, **mods, **oracle_extra)
    assert_close(got_out, want_out, atol=1e-12, name="out")
    assert_close(got_lse, want_lse, atol=1e-12, name="lse")
    want = attention_reference_backward(dout, q, k, v, **builtin, **oracle_extra)
    got = attention_reference_backward(dout, q, k, v, **mods, **oracle_extra)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, atol=1e-12, name=name)
    # The public call (the NumPy path) against the oracle, forward and backward.
    # (lse is float32, and the backward recomputes P from it)
    out, lse = cuflash.attention(q, k, v, **mods, **extra, return_lse=True)
    assert_close(out, want_out, atol=TOLERANCE[p["dtype"]] * 10, name="api out")
    assert_lse_close(lse, want_lse, atol=1e-6 * (1 + np.abs(want_lse[np.isfinite(want_lse)]).max(initial=0)))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **mods, **extra)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(g, w, atol=API_GRAD_TOLERANCE[p["dtype"]], name=f"api {name}")


@settings(max_examples=30, deadline=None)
@given(p=problems(), lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3))
def test_varlen_mods_see_the_sequence_index(p, lengths):
    """Sequence b of a packed call with mods is the dense call of that sequence alone whose
    mods read row b of the tensor."""
    rng = np.random.default_rng(p["seed"])
    batch = len(lengths)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum([n[i] for n in lengths])]).astype(np.int32) for i in (0, 1))
    nheads, nheads_kv, d, dtype = p["nheads"], p["nheads_kv"], p["d"], p["dtype"]
    q = rng.standard_normal((int(cu_q[-1]), nheads, d)).astype(dtype)
    k, v = (rng.standard_normal((int(cu_k[-1]), nheads_kv, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    bias = rng.standard_normal((batch, nheads)).astype(np.float32)
    score_mod = lambda s, b, h, i, j, bias: s + bias[b, h] * (i - j)  # noqa: E731
    mask_mod = lambda b, h, i, j, bias: (j <= i + b) | (bias[b, h] > 1)  # noqa: E731
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=(bias,))
    longest_q, longest_k = max(n[0] for n in lengths), max(n[1] for n in lengths)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, longest_q, longest_k, return_lse=True, **mods)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, longest_q, longest_k, **mods)
    oracle_out, oracle_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, **mods)
    oracle_grads = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, **mods)
    assert_close(out, oracle_out, atol=TOLERANCE[dtype] * 10)
    assert_lse_close(lse, oracle_lse, atol=1e-6 * (1 + np.abs(oracle_lse[np.isfinite(oracle_lse)]).max(initial=0)))
    for g, w in zip(grads, oracle_grads):
        assert_close(g, w, atol=API_GRAD_TOLERANCE[dtype])
    for b in range(batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        row = bias[b]
        alone = dict(score_mod=lambda s, _, h, i, j, t: s + t[h] * (i - j),
                     mask_mod=lambda _, h, i, j, t, b=b: (j <= i + b) | (t[h] > 1), mod_tensors=(row,))
        o, l = attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], **alone)
        assert_close(oracle_out[rows_q], o[0], atol=1e-12)
        assert_close(oracle_lse[:, rows_q], l[0], atol=1e-12)


# -- masks and biases from tensors against a dense computation -------------------------------------------

def _dense(q, k, v, bias, visible, scale=None):
    """softmax(scale q.k + bias, visible keys only) v in float64, with lse; bias and visible
    are functions of (b, h, i, j) index arrays."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    batch, sq, nheads, d = q.shape
    group = nheads // k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    b, h = np.arange(batch)[:, None, None, None], np.arange(nheads)[:, None, None]
    i, j = np.arange(sq)[:, None], np.arange(k.shape[1])
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = scale * np.einsum("bihd,bjhd->bhij", q, kk) + bias(b, h, i, j)
    s = np.where(np.broadcast_to(visible(b, h, i, j), s.shape), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    w = np.exp(s - m)
    total = w.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", w / np.where(total == 0, 1, total), vv)
    lse = np.where(total[..., 0] == 0, np.inf, m[..., 0] + np.log(np.where(total == 0, 1, total))[..., 0])
    return out, lse


L = 7
REL = np.random.default_rng(3).standard_normal((4, 2 * L - 1)).astype(np.float32)
DOC = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]], np.int32)


def _rel_bias(s, b, h, q_idx, kv_idx, rel, doc):
    return s + rel[h, q_idx - kv_idx + L - 1]


def _same_document(b, h, q_idx, kv_idx, rel, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def _prefix_lm(b, h, q_idx, kv_idx, rel, doc):
    return (kv_idx < 3) | (kv_idx <= q_idx)


CASES = {
    "document": (dict(mask_mod=_same_document),
                 lambda b, h, i, j: 0.0, lambda b, h, i, j: DOC[b, i] == DOC[b, j]),
    "document+causal": (dict(mask_mod=_same_document, causal=True),
                        lambda b, h, i, j: 0.0, lambda b, h, i, j: (DOC[b, i] == DOC[b, j]) & (j <= i)),
    "prefix-lm": (dict(mask_mod=_prefix_lm), lambda b, h, i, j: 0.0, lambda b, h, i, j: (j < 3) | (j <= i)),
    "relative bias": (dict(score_mod=_rel_bias), lambda b, h, i, j: REL[h, i - j + L - 1],
                      lambda b, h, i, j: True),
    "relative bias+document+window": (dict(score_mod=_rel_bias, mask_mod=_same_document, window_size=(2, 1)),
                                      lambda b, h, i, j: REL[h, i - j + L - 1],
                                      lambda b, h, i, j: (DOC[b, i] == DOC[b, j]) & (j >= i - 2) & (j <= i + 1)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("nheads_kv", [1, 4])
def test_masks_and_biases_from_tensors(case, nheads_kv):
    options, bias, visible = CASES[case]
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, L, 4, 5))
    k, v = (rng.standard_normal((2, L, nheads_kv, 5)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    want_out, want_lse = _dense(q, k, v, bias, visible)
    options = dict(options, mod_tensors=(REL, DOC))
    out, lse = attention_reference(q, k, v, **options)
    assert_close(out, want_out, atol=1e-12, name="oracle out")
    assert_close(lse, want_lse, atol=1e-12, name="oracle lse")
    for blocks in (dict(block_q=2, block_k=3), dict()):
        cpu_options = dict(dict(causal=False, softmax_scale=None), **options)
        got_out, got_lse = cpu.attention_forward(q, k, v, **cpu_options, **blocks)
        assert_close(got_out, want_out, atol=1e-12, name="cpu out")
        assert_close(got_lse, want_lse, atol=1e-6, name="cpu lse")  # (lse is float32)
        grads = cpu.attention_backward(dout, q, k, v, got_out, got_lse, **cpu_options, **blocks)
        oracle = attention_reference_backward(dout, q, k, v, **options)
        for name, g, w in zip(("dq", "dk", "dv"), grads, oracle):
            assert_close(g, w, atol=1e-5, name=f"cpu {name}")


@pytest.mark.parametrize("options", [
    dict(score_mod=lambda s, b, h, i, j, t: mod.where(s > 0, s * mod.sigmoid(s), s / 2) + t[h, i],
         mask_mod=lambda b, h, i, j, t: (j <= i) | (t[h, j] > 0.5)),
    dict(score_mod=lambda s, b, h, i, j, t: mod.log(1 + s * s) - abs(s) * t[h, j] + mod.maximum(s, -0.5) ** 2,
         softcap=0.8, causal=True),
])
def test_oracle_gradients_match_finite_differences(options):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 2, 3))
    k, v = (rng.standard_normal((1, 5, 1, 3)) for _ in range(2))
    t = rng.random((2, 5))
    dout = rng.standard_normal(q.shape)
    dlse = rng.standard_normal((1, 2, 4))
    options = dict(options, mod_tensors=(t,))

    def loss():
        out, lse = attention_reference(q, k, v, **options)
        return float((out * dout).sum() + (np.where(np.isinf(lse), 0, lse) * dlse).sum())

    grads = attention_reference_backward(dout, q, k, v, dlse=dlse, **options)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_close(g, finite_difference(loss, x), atol=1e-6, name=name)


def test_a_fully_masked_row_gives_zero_and_infinite_lse():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 5, 2, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 6, 1, 4)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    # Row 1 masked by mask_mod, row 3 by a score_mod that gives -inf, for every head and batch.
    # Row 1's scores are sqrt of negative numbers there: NaN, with NaN derivatives, both masked.
    options = dict(score_mod=lambda s, b, h, i, j: mod.where(i == 3, -INF, mod.where(i == 1, mod.sqrt(s), s)),
                   mask_mod=lambda b, h, i, j: i != 1)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert (out[:, [1, 3]] == 0).all() and (lse[..., [1, 3]] == np.inf).all()
    assert np.isfinite(out).all() and np.isfinite(lse[..., [0, 2, 4]]).all()
    dlse = np.where(np.isinf(lse), np.float32(np.nan), np.float32(1))
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    assert (dq[:, [1, 3]] == 0).all() and all(np.isfinite(g).all() for g in (dq, dk, dv))
    oracle_out, oracle_lse = attention_reference(q, k, v, **options)
    assert_close(out, oracle_out, atol=1e-5)
    assert_lse_close(lse, oracle_lse, atol=1e-5)
    for g, w in zip((dq, dk, dv), attention_reference_backward(dout, q, k, v, dlse=dlse, **options)):
        assert_close(g, w, atol=1e-4)
    # Every key masked: out 0, lse +inf, gradients 0.
    never = dict(mask_mod=lambda b, h, i, j: i < 0)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **never)
    assert (out == 0).all() and (lse == np.inf).all()
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=np.full_like(lse, np.nan), **never)
    assert all((g == 0).all() for g in grads)


# -- errors --------------------------------------------------------------------------------------------

SLOPES = np.full(4, 0.5, np.float32)


def branchy(s, b, h, q, k):
    return s if s > 0 else -s


def truthy(s, b, h, q, k):
    return s * bool(q)


def integral(s, b, h, q, k):
    return s * int(q)


def floating(s, b, h, q, k):
    return s * float(k)


def mathy(s, b, h, q, k):
    return math.exp(s)


def iterating(s, b, h, q, k):
    return sum(x for x in s)


def both(s, b, h, q, k):
    return s * ((q > 0) and (k > 0))


def chained(s, b, h, q, k):
    return mod.where(0 <= q < 3, s, 0.0)


def ranged(s, b, h, q, k):
    return s + len(range(q))


def xor(s, b, h, q, k):
    return mod.where((q > 0) ^ (k > 0), s, 0.0)


def shifted(s, b, h, q, k):
    return s * (q << 1)


def matmul(s, b, h, q, k):
    return s @ s


def sine(s, b, h, q, k):
    return np.sin(s)


def float_modulo(s, b, h, q, k):
    return s % 2.0


def float_floor(s, b, h, q, k):
    return s // 2


def symbolic_power(s, b, h, q, k):
    return 2 ** s


def captured(s, b, h, q, k):
    return s + SLOPES[h]


def captured_product(s, b, h, q, k):
    return s + SLOPES * s


def method(s, b, h, q, k):
    return s.exp()


def bitwise_ints(s, b, h, q, k):
    return mod.where((q & 1) == 0, s, 0.0)


def not_indexed(s, b, h, q, k, t):
    return s + t


def boolean_score(s, b, h, q, k):
    return s > 0


def integer_score(s, b, h, q, k):
    return q - k


def nothing(s, b, h, q, k):
    s + 1


def constant(s, b, h, q, k):
    return 0.5


def float_mask(b, h, q, k):
    return q * 1.0


def integer_mask(b, h, q, k):
    return q - k


def too_few(b, h, q):
    return q > 0


def too_many(s, b, h, q, k, t):
    return s


def bad_where(s, b, h, q, k):
    return mod.where(q, s, 0.0)


def big_constant(s, b, h, q, k):
    return s + q * 2**40


def by_zero(s, b, h, q, k):
    return s + q // 0


def wrong_indices(s, b, h, q, k, t):
    return s + t[h, q]


def constant_index(s, b, h, q, k, t):
    return s + t[9]


def slice_index(s, b, h, q, k, t):
    return s + t[1:3][0]


def float_index(s, b, h, q, k, t):
    return s + t[s]


# Functions traced without mod tensors: (function, error, message).
PLAIN_TRACE_ERRORS = [
    (branchy, TypeError, r"used in Python control flow: `if`"),
    (truthy, TypeError, r"control flow: `if`, .*bool\(\)"),
    (integral, TypeError, r"control flow: int\(\)"),
    (floating, TypeError, r"control flow: float\(\)"),
    (mathy, TypeError, r"float\(\) \(or a `math` function"),
    (iterating, TypeError, r"iteration"),
    (both, TypeError, r"`and`, `or`"),
    (chained, TypeError, r"chained comparison"),
    (ranged, TypeError, r"a Python index \(range\(\)"),
    (xor, TypeError, r"\^ is not supported"),
    (shifted, TypeError, r"a bit shift is not supported"),
    (matmul, TypeError, r"@ is not supported"),
    (sine, TypeError, r"NumPy's sin is not supported"),
    (float_modulo, TypeError, r"% takes integer operands"),
    (float_floor, TypeError, r"// takes integer operands"),
    (symbolic_power, TypeError, r"a symbolic exponent is not supported"),
    (captured, TypeError, r"pass arrays in mod_tensors"),
    (captured_product, TypeError, r"arrays enter a traced function only as mod_tensors"),
    (method, AttributeError, r"no attribute 'exp'"),
    (bitwise_ints, TypeError, r"& takes booleans"),
    (boolean_score, TypeError, r"must return a float score, got a bool expression"),
    (integer_score, TypeError, r"must return a float score, got an int expression"),
    (nothing, TypeError, r"must return a symbolic expression .* got NoneType"),
    (constant, TypeError, r"must return a symbolic expression .* got float 0.5"),
    (too_many, TypeError, r"must take 5 positional arguments"),
    (bad_where, TypeError, r"where's condition must be a boolean"),
    (big_constant, ValueError, r"outside int32"),
    (by_zero, ZeroDivisionError, r"// by the constant 0"),
]

# Functions traced with mod tensors: (function, mod_tensors, error, message).
TENSOR_TRACE_ERRORS = [
    (not_indexed, (SLOPES,), TypeError, r"mod tensor 't' \(mod_tensors\[0\]\) must be indexed"),
    (wrong_indices, (SLOPES,), IndexError, r"'t' \(mod_tensors\[0\]\) of shape \(4,\) takes 1 indices"),
    (constant_index, (SLOPES,), IndexError, r"must be in \[0, 4\), got 9"),
    (slice_index, (SLOPES,), TypeError, r"index 0 of 't' \(mod_tensors\[0\]\) must be a symbolic value"),
    (float_index, (SLOPES,), TypeError, r"must be an integer expression, got a float one"),
    (too_many, ([1.0, 2.0],), TypeError, r"mod_tensors\[0\] must be a NumPy array \(the NumPy path\), got builtins"),
    (too_many, (SLOPES.astype(np.uint8),), TypeError, r"mod_tensors\[0\] must have a dtype among .* got uint8"),
]

TRACE_ERRORS = [(fn, (), error, message) for fn, error, message in PLAIN_TRACE_ERRORS] + TENSOR_TRACE_ERRORS


@pytest.mark.parametrize("fn,tensors,error,message", TRACE_ERRORS, ids=[e[0].__name__ + str(len(e[1]))
                                                                        for e in TRACE_ERRORS])
def test_tracing_errors_name_the_function(fn, tensors, error, message):
    with pytest.raises(error, match=message) as info:
        trace(fn, "score", tensors)
    assert f"score_mod {fn.__name__!r} (test_mod.py:" in str(info.value)
    # The same error from the public call, before anything runs.
    q, k, v = (np.ones((1, 3, 4 if i == 0 else 2, 4), np.float32) for i in range(3))
    with pytest.raises(error, match=message):
        cuflash.attention(q, k, v, score_mod=fn, mod_tensors=tensors)


@pytest.mark.parametrize("fn,message", [
    (float_mask, "must return a boolean .False: masked., got a float expression"),
    (integer_mask, "must return a boolean .False: masked., got an int expression"),
    (too_few, "must take 4 positional arguments"),
])
def test_mask_errors_name_the_function(fn, message):
    with pytest.raises(TypeError, match=message) as info:
        trace(fn, "mask")
    assert f"mask_mod {fn.__name__!r}" in str(info.value)


def test_index_out_of_range_at_run_time_names_the_tensor_and_the_function():
    q = np.ones((1, 5, 2, 4), np.float32)
    k = v = np.ones((1, 6, 2, 4), np.float32)
    table = np.ones((2, 6), np.float32)

    def relative(s, b, h, q_idx, kv_idx, table):
        return s + table[h, q_idx - kv_idx]   # negative for kv_idx > q_idx

    with pytest.raises(IndexError, match=r"score_mod 'relative' .*index 1 of mod tensor 'table' \(mod_tensors\[0\]\) "
                                         r"\(shape \(2, 6\)\) must be in \[0, 6\), got values from -5 to 4"):
        cuflash.attention(q, k, v, score_mod=relative, mod_tensors=(table,))
    with pytest.raises(IndexError, match="'relative'"):
        attention_reference(q, k, v, score_mod=relative, mod_tensors=(table,))

    def document(b, h, q_idx, kv_idx, doc):
        return doc[b, kv_idx] == doc[b, q_idx]

    with pytest.raises(IndexError, match=r"mask_mod 'document' .*index 1 of mod tensor 'doc'.*must be in \[0, 5\)"):
        cuflash.attention(q, k, v, mask_mod=document, mod_tensors=(np.zeros((1, 5), np.int32),))
    with pytest.raises(ZeroDivisionError, match=r"score_mod '<lambda>' .*integer // by zero"):
        cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + i // j)


def test_argument_errors():
    q, k, v = (np.ones((1, 3, 2, 4), np.float32) for _ in range(3))
    with pytest.raises(TypeError, match="score_mod must be a function"):
        cuflash.attention(q, k, v, score_mod="tanh")
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        cuflash.attention_backward(q, q, k, v, q, np.zeros((1, 2, 3), np.float32), mask_mod=1)
    with pytest.raises(TypeError, match="mod_tensors must be a tuple"):
        cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s, mod_tensors=SLOPES)
    with pytest.raises(ValueError, match="mod_tensors are the extra arguments"):
        cuflash.attention(q, k, v, mod_tensors=(SLOPES,))
    with pytest.raises(ValueError, match="mod_tensors are the extra arguments"):
        attention_reference(q, k, v, mod_tensors=(SLOPES,))
    with pytest.raises(TypeError, match="mod_tensors.0. must be a NumPy array"):
        cpu.attention_forward(q, k, v, causal=False, softmax_scale=None, mask_mod=lambda b, h, i, j, t: i < j,
                              mod_tensors=(mod.TensorSpec(0, None, (4,), "float32"),))
    with pytest.raises(ValueError, match="kind must be one of"):
        trace(lambda s, b, h, i, j: s, "bias")
    with pytest.raises(ValueError, match="name must be a C identifier"):
        to_cuda(trace(lambda s, b, h, i, j: s), "2fast")


def test_paged_calls_refuse_mods():
    """The paged varlen call (block_table) and the KV-cache call take no mods: a clear
    error, before anything runs."""
    q, k, v = (np.ones((1, 3, 2, 8), np.float32) for _ in range(3))
    with pytest.raises(NotImplementedError, match="attention_with_kvcache does not take score_mod"):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=3, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(NotImplementedError, match="does not take score_mod, mask_mod or mod_tensors"):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=3, mask_mod=lambda b, h, i, j: i >= j)
    with pytest.raises(NotImplementedError, match="do not take block_table"):
        cuflash.attention_varlen(q[0], k[0], v[0], np.int32([0, 3]), np.int32([0, 3]), 3, 3,
                                 block_table=np.zeros((1, 1), np.int32), mask_mod=lambda b, h, i, j: i >= j)


def test_without_mods_nothing_changes():
    assert not _options.has_mods(None, None, ()) and not _options.has_mods(None, None, [])
    assert _options.has_mods(None, None, (SLOPES,)) and _options.has_mods(lambda *a: a[0], None, ())
    assert mod.prepare(None, None, ()) is None


# -- the CUDA printer ----------------------------------------------------------------------------------

def _kernels_source():
    """Every operation, type and tensor dtype in one score_mod, its derivative and a mask_mod."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (NumPy bfloat16)")
    tensors = (np.zeros((2, 5), np.int64), np.zeros((3, 7), np.float32), np.zeros((), np.float64),
               np.zeros(4, bool), np.zeros(3, np.int32), np.zeros(2, np.float16), np.zeros(2, ml_dtypes.bfloat16))

    def everything(s, b, h, q, k, doc, bias, c, flag, i32, half, brain):
        x = mod.where(flag[h % 4] & (doc[b, q] == doc[b, k]), s + bias[h % 3, (q - k) % 7] * half[b], -INF)
        y = mod.minimum(mod.exp(x), mod.log(abs(s) + 1)) + mod.maximum(mod.sqrt(abs(s)), mod.sigmoid(s)) ** 1.5
        z = y - c[()] * i32[k % 3] + mod.tanh(s) ** 2 + float("nan") * (q // -2 == k % -3) + abs(-q)
        return z + mod.minimum(q, k) - mod.maximum(q, 2) / 3 + 1e39 - 1e-7 + (q > 0) * 0.5 + brain[h % 2]

    score = trace(everything, "score", tensors)
    mask = trace(lambda b, h, q, k, *t: (~(q < k) | (b != 0)) & (t[3][h] == True), "mask", tensors)  # noqa: E712
    text = to_cuda(score, "score_fn") + to_cuda(derivative(score), "score_grad") + to_cuda(mask, "mask_fn")
    call = "0, 1, 2, 3, doc, 5, 1, 2, 5, bias, 7, 1, 3, 7, c, flag, 1, 4, i32, 1, 3, half, 1, 2, brain, 1, 2"
    text += ('extern "C" __global__ void probe(float* out, const long long* doc, const float* bias, '
             'const double* c, const bool* flag, const int* i32, const unsigned short* half, '
             'const unsigned short* brain)\n'
             f'{{ out[0] = score_fn(out[1], {call}) + score_grad(out[1], {call}); out[2] = mask_fn({call}); }}\n')
    return text


def test_cuda_text_is_straight_line_code_without_headers():
    tree = trace(lambda s, b, h, q, k, t: 5 * mod.tanh(s / 5) - t[h] * abs(q - k + 2), "score", (SLOPES,))
    text = to_cuda(tree, "softcap_alibi")
    assert "__device__ __forceinline__ float softcap_alibi(const float score, const int b, const int h, " \
           "const int q_idx, const int kv_idx, const float* __restrict__ t0, const long long t0_stride0, " \
           "const int t0_size0)" in text
    assert "min(max(h, 0), t0_size0 - 1)" in text  # (indices clamped into the tensor)
    assert "tanhf(" in text and "#include" not in text and tree.text in text
    assert to_cuda(tree, "softcap_alibi") == text
    mask = to_cuda(trace(lambda b, h, q, k: q // 3 >= k % -2, "mask"), "blocks")
    assert "bool blocks(const int b, const int h, const int q_idx, const int kv_idx)" in mask


def test_cuda_text_compiles_with_nvrtc():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                                reason="NVRTC (the cuda12/cuda13 extra) is not installed")
    try:
        nvrtc.getVersion()
    except Exception as error:  # noqa: BLE001 - a wheel without its library
        pytest.skip(f"NVRTC is not loadable: {error}")
    source = _kernels_source()
    program = nvrtc.createProgram(source, "mods.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, ["--gpu-architecture=sm_80"])
        except Exception:
            pytest.fail(f"NVRTC rejected the text:\n{nvrtc.getProgramLog(program)}\n{source}")
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert ".entry probe" in ptx
