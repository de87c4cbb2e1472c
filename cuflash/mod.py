"""Programmable attention: ``score_mod`` and ``mask_mod`` traced into expression trees.

FlexAttention's vocabulary. A score modifier ``score_mod(score, b, h, q_idx, kv_idx,
*mod_tensors) -> score`` rewrites each score (``score`` is softmax_scale * q.k after the
built-in softcap and ALiBi; ``h`` the query head); a mask ``mask_mod(b, h, q_idx, kv_idx,
*mod_tensors) -> bool`` hides a key where it is False. ``b`` is the batch element (the
sequence of a packed batch), ``q_idx`` and ``kv_idx`` positions inside that sequence.

``trace`` calls the function once on symbols: every operation on them builds a node of an
immutable, hashable tree with one canonical text (``Traced.text``). The tree has three
printers: ``to_numpy`` (a vectorised NumPy evaluator: what the NumPy path and the oracle
run), ``to_cuda`` (a ``__device__`` function's text) and ``derivative`` (d score_mod /
d score as another tree, for the backward). ``kernel_source`` is the CUDA text the mma.sync
kernels of a call compile with; ``index_ranges`` checks a tree's indices over a call's
positions before they run. ``create_block_mask`` evaluates a mask over every position once
and keeps the status of each 128 x 128 block (``BlockMask``, FlexAttention's): the kernels
skip the tiles of its empty blocks and the mask of its full ones.

Types: ``float`` (32-bit on the GPU), ``int`` (index arithmetic; 32-bit on the GPU, so it
must stay within int32) and ``bool``. int mixed with float becomes float, bool mixed with
numbers becomes int, ``/`` is always float division, ``//`` and ``%`` take integers and
round toward minus infinity (Python's rule), ``minimum``/``maximum`` of floats ignore a NaN
operand (C's fminf/fmaxf).
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import math
import numbers
import operator
import os
import re
from typing import NamedTuple

import numpy as np

__all__ = ["trace", "to_numpy", "to_cuda", "derivative", "Traced", "Node", "TensorSpec", "BlockMask",
           "create_block_mask", "exp", "log", "tanh", "abs", "sqrt", "sigmoid", "minimum", "maximum", "where"]

FLOAT, INT, BOOL = "float", "int", "bool"
KINDS = ("score", "mask")
SCORE_VARIABLES = ("score", "b", "h", "q_idx", "kv_idx")
MASK_VARIABLES = ("b", "h", "q_idx", "kv_idx")
TENSOR_DTYPES = ("bool", "int32", "int64", "float16", "bfloat16", "float32", "float64")
INT32_LIMIT = 2**31

_SIGNATURES = {"score": "(score, b, h, q_idx, kv_idx, *mod_tensors) -> score",
               "mask": "(b, h, q_idx, kv_idx, *mod_tensors) -> bool"}
_UNARY_FLOAT = ("exp", "log", "tanh", "sqrt", "sigmoid")
_COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_ARITHMETIC = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


# -- the tree ------------------------------------------------------------------------------------

def _value_key(value):
    # 0.0 and -0.0 (and NaN and NaN) are different constants: compare floats by their bits.
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


class Node:
    """One immutable node: ``op`` (var, const, load, cast, an operator or a function), its
    result ``type`` (float, int or bool), child nodes ``args`` and a payload ``value`` (a
    variable's name, a constant, a load's (tensor position, dtype, ndim), pow's exponent).
    Equal trees are equal and hash alike; ``text`` is the canonical text."""
    __slots__ = ("op", "type", "args", "value", "_hash", "_text")

    def __init__(self, op: str, type: str, args: tuple = (), value=None):
        for name, v in (("op", op), ("type", type), ("args", tuple(args)), ("value", value), ("_text", None)):
            object.__setattr__(self, name, v)
        object.__setattr__(self, "_hash", hash((op, type, _value_key(value), self.args)))

    def __setattr__(self, name, value):
        raise AttributeError("expression nodes are immutable")

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return (isinstance(other, Node) and self._hash == other._hash and self.op == other.op
                and self.type == other.type and _value_key(self.value) == _value_key(other.value)
                and self.args == other.args)

    @property
    def text(self) -> str:
        if self._text is None:
            object.__setattr__(self, "_text", _text(self))
        return self._text

    def __repr__(self):
        return f"Node({self.text})"


def _text(node: Node) -> str:
    if node.op == "var":
        return node.value
    if node.op == "const":
        return {True: "true", False: "false"}[node.value] if node.type == BOOL else repr(node.value)
    if node.op == "load":
        position, dtype, _ = node.value
        return f"t{position}:{dtype}[{', '.join(a.text for a in node.args)}]"
    if node.op == "cast":
        return f"{node.type}({node.args[0].text})"
    if node.op == "pow":
        return f"pow({node.args[0].text}, {node.value!r})"
    return f"{node.op}({', '.join(a.text for a in node.args)})"


def _const(value) -> Node:
    if isinstance(value, bool):
        return Node("const", BOOL, value=value)
    if isinstance(value, int):
        return Node("const", INT, value=value)
    return Node("const", FLOAT, value=float(value))


_ZERO, _ONE = _const(0.0), _const(1.0)


def _cast(node: Node, type: str) -> Node:
    if node.type == type:
        return node
    if node.op == "const":  # (folded, so that 2 * x reads mul(2.0, x) rather than mul(float(2), x))
        return _const({FLOAT: float, INT: int, BOOL: bool}[type](node.value))
    return Node("cast", type, (node,))


class TensorSpec(NamedTuple):
    """A mod tensor as the tree sees it: its position in ``mod_tensors``, the parameter name
    the function gave it (or None), its shape and its dtype name."""
    position: int
    name: str | None
    shape: tuple
    dtype: str

    @property
    def label(self) -> str:
        where = f"mod_tensors[{self.position}]"
        return where if self.name is None else f"{self.name!r} ({where})"


class Traced(NamedTuple):
    """A traced function: ``kind`` ("score" or "mask"), the tree's ``root``, the mod
    ``tensors`` it may read and ``name``, the function as error messages name it."""
    kind: str
    root: Node
    tensors: tuple
    name: str

    @property
    def text(self) -> str:
        return self.root.text

    def __str__(self):
        return self.text


# -- symbols -------------------------------------------------------------------------------------

class _Context:
    """The function being traced, for error messages."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def error(self, kind, message: str):
        return kind(f"{self.name}: {message}")


def _control_flow(construct: str):
    def refuse(self, *args):
        raise self._ctx.error(TypeError, f"a symbolic value ({self.node.text}) is used in Python control flow: "
                                         f"{construct}. A traced function runs once, on symbols whose values "
                                         f"Python cannot see; use cuflash.mod.where(cond, a, b) for a choice and "
                                         f"& | ~ for logic")
    return refuse


def _unsupported(what: str, hint: str = ""):
    def refuse(self, *args, **kwargs):
        raise self._ctx.error(TypeError, f"{what} is not supported on a symbolic value{hint}")
    return refuse


class Sym:
    """A symbolic value inside a traced function: a tree node, built by operators."""
    __slots__ = ("node", "_ctx")
    __array_priority__ = 1000

    def __init__(self, node: Node, ctx: _Context):
        self.node, self._ctx = node, ctx

    def __repr__(self):
        return f"<cuflash.mod symbol {self.node.type} {self.node.text}>"

    # arithmetic
    def __add__(self, other): return _arith(self._ctx, "add", self, other)
    def __radd__(self, other): return _arith(self._ctx, "add", other, self)
    def __sub__(self, other): return _arith(self._ctx, "sub", self, other)
    def __rsub__(self, other): return _arith(self._ctx, "sub", other, self)
    def __mul__(self, other): return _arith(self._ctx, "mul", self, other)
    def __rmul__(self, other): return _arith(self._ctx, "mul", other, self)
    def __truediv__(self, other): return _arith(self._ctx, "div", self, other)
    def __rtruediv__(self, other): return _arith(self._ctx, "div", other, self)
    def __floordiv__(self, other): return _integer(self._ctx, "floordiv", self, other)
    def __rfloordiv__(self, other): return _integer(self._ctx, "floordiv", other, self)
    def __mod__(self, other): return _integer(self._ctx, "mod", self, other)
    def __rmod__(self, other): return _integer(self._ctx, "mod", other, self)
    def __pow__(self, other): return _pow(self._ctx, self, other)
    def __neg__(self): return _unary(self._ctx, "neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary(self._ctx, "abs", self)

    # comparisons and logic
    def __lt__(self, other): return _compare(self._ctx, "lt", self, other)
    def __le__(self, other): return _compare(self._ctx, "le", self, other)
    def __gt__(self, other): return _compare(self._ctx, "gt", self, other)
    def __ge__(self, other): return _compare(self._ctx, "ge", self, other)
    def __eq__(self, other): return _compare(self._ctx, "eq", self, other)
    def __ne__(self, other): return _compare(self._ctx, "ne", self, other)
    def __and__(self, other): return _logic(self._ctx, "and", self, other)
    def __rand__(self, other): return _logic(self._ctx, "and", other, self)
    def __or__(self, other): return _logic(self._ctx, "or", self, other)
    def __ror__(self, other): return _logic(self._ctx, "or", other, self)
    def __invert__(self): return _unary(self._ctx, "not", self)

    # Python control flow and conversions: the value is unknown while tracing
    __bool__ = _control_flow("`if`, `while`, `and`, `or`, `not`, a chained comparison (a < b < c) or bool()")
    __int__ = _control_flow("int()")
    __float__ = _control_flow("float() (or a `math` function, which converts to float)")
    __complex__ = _control_flow("complex()")
    __index__ = _control_flow("a Python index (range(), a list or NumPy subscript); pass arrays in "
                              "mod_tensors and index those")
    __iter__ = _control_flow("iteration (for, unpacking, list())")
    __len__ = _control_flow("len()")
    __hash__ = _control_flow("hashing (a set member or dict key)")
    __round__ = _control_flow("round()")
    __trunc__ = _control_flow("math.trunc()")
    __floor__ = _control_flow("math.floor()")
    __ceil__ = _control_flow("math.ceil()")

    # operations with no meaning here
    __xor__ = __rxor__ = _unsupported("^", "; use & | ~ on booleans")
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _unsupported("a bit shift")
    __matmul__ = __rmatmul__ = _unsupported("@")
    __divmod__ = __rdivmod__ = _unsupported("divmod()", "; use // and %")
    __rpow__ = _unsupported("a symbolic exponent", "; use exp(x * log(base))")
    __getitem__ = _unsupported("indexing", "; only mod tensors are indexed")
    __call__ = _unsupported("calling")
    __array__ = _unsupported("conversion to a NumPy array (np.asarray, or a NumPy array indexed by a symbolic "
                             "value)", "; pass arrays in mod_tensors and index those")

    def __getattr__(self, name):
        if name.startswith("__") or name in ("node", "_ctx"):
            raise AttributeError(name)
        raise self._ctx.error(AttributeError, f"symbolic values have no attribute {name!r}; the operations are "
                                              f"Python's operators and cuflash.mod's functions")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        function = _UFUNCS.get(ufunc.__name__)
        if method != "__call__" or kwargs or function is None:
            raise self._ctx.error(TypeError, f"NumPy's {ufunc.__name__} is not supported on a symbolic value; "
                                             f"cuflash.mod offers {', '.join(_FUNCTIONS)}")
        return function(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.where and len(args) == 3 and not kwargs:
            return where(*args)
        raise self._ctx.error(TypeError, f"numpy.{func.__name__} is not supported on a symbolic value; "
                                         f"cuflash.mod offers {', '.join(_FUNCTIONS)}")


class SymTensor:
    """A mod tensor inside a traced function: known shape and dtype, read by indexing it with
    one integer expression per dimension (``bias[h, q_idx - kv_idx + L]``)."""
    __slots__ = ("spec", "_ctx")

    def __init__(self, spec: TensorSpec, ctx: _Context):
        self.spec, self._ctx = spec, ctx

    @property
    def shape(self) -> tuple:
        return self.spec.shape

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.spec.dtype)

    def __len__(self):
        if not self.spec.shape:
            raise self._ctx.error(TypeError, f"len() of the 0-d mod tensor {self.spec.label}")
        return self.spec.shape[0]

    def __repr__(self):
        return f"<cuflash.mod tensor {self.spec.label} {self.spec.dtype}{list(self.spec.shape)}>"

    def __getitem__(self, key):
        ctx, spec = self._ctx, self.spec
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(spec.shape):
            raise ctx.error(IndexError, f"mod tensor {spec.label} of shape {spec.shape} takes {len(spec.shape)} "
                                        f"indices, one per dimension, got {len(key)}")
        indices = []
        for axis, (index, size) in enumerate(zip(key, spec.shape)):
            node = _operand(ctx, index, f"index {axis} of {spec.label}")
            if node.type != INT:
                raise ctx.error(TypeError, f"index {axis} of mod tensor {spec.label} must be an integer expression, "
                                           f"got {_article(node.type)} one ({node.text})")
            if node.op == "const" and not 0 <= node.value < size:
                raise ctx.error(IndexError, f"index {axis} of mod tensor {spec.label} (shape {spec.shape}) must be "
                                            f"in [0, {size}), got {node.value}")
            indices.append(node)
        type = BOOL if spec.dtype == "bool" else INT if spec.dtype.startswith("int") else FLOAT
        return Sym(Node("load", type, indices, (spec.position, spec.dtype, len(spec.shape))), ctx)

    def __iter__(self):
        raise self._ctx.error(TypeError, f"iteration over the mod tensor {self.spec.label}: index it with "
                                         f"integer expressions instead")

    def __bool__(self):
        raise self._ctx.error(TypeError, f"the mod tensor {self.spec.label} is used in Python control flow")

    def __array__(self, *args, **kwargs):
        raise self._ctx.error(TypeError, f"the mod tensor {self.spec.label} is symbolic while tracing: index it "
                                         f"with integer expressions")


def _tensor_misuse(self, *args, **kwargs):
    raise self._ctx.error(TypeError, f"the mod tensor {self.spec.label} must be indexed (t[i, j], one integer "
                                     f"expression per dimension) before it enters an expression")


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "matmul", "lt", "le",
              "gt", "ge"):
    setattr(SymTensor, f"__{_name}__", _tensor_misuse)
    setattr(SymTensor, f"__r{_name}__", _tensor_misuse)
for _name in ("neg", "pos", "abs", "invert", "int", "float", "index"):
    setattr(SymTensor, f"__{_name}__", _tensor_misuse)
SymTensor.__array_ufunc__ = _tensor_misuse
SymTensor.__eq__ = SymTensor.__ne__ = _tensor_misuse
SymTensor.__hash__ = None


def _article(type: str) -> str:
    return f"an {type}" if type == INT else f"a {type}"


def _operand(ctx: _Context, x, role: str = "an operand") -> Node:
    """A Sym's node or a constant's."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, SymTensor):
        _tensor_misuse(x)
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biuf":  # (NumPy's scalars become these)
        x = x[()]
    if isinstance(x, (bool, np.bool_)):
        return _const(bool(x))
    if isinstance(x, numbers.Integral):
        if not -INT32_LIMIT < int(x) < INT32_LIMIT:
            raise ctx.error(ValueError, f"the integer constant {int(x)} is outside int32, the type of index "
                                        f"arithmetic on the GPU")
        return _const(int(x))
    if isinstance(x, numbers.Real):
        return _const(float(x))
    if isinstance(x, np.ndarray) or hasattr(x, "__array_interface__") or hasattr(x, "__cuda_array_interface__"):
        raise ctx.error(TypeError, f"{role} is an array ({type(x).__name__}): arrays enter a traced function "
                                   f"only as mod_tensors, indexed by symbolic indices")
    raise ctx.error(TypeError, f"{role} must be a symbolic value or a real constant, got {type(x).__name__}")


def _context(*xs) -> _Context | None:
    for x in xs:
        if isinstance(x, (Sym, SymTensor)):
            return x._ctx
    return None


def _numeric(node: Node) -> Node:
    if node.type == BOOL:  # (True + 1 is 2 in Python and C alike)
        return _cast(node, INT)
    return node


def _promote(a: Node, b: Node) -> tuple[Node, Node, str]:
    type = FLOAT if FLOAT in (a.type, b.type) else INT
    return _cast(a, type), _cast(b, type), type


def _arith(ctx, op, x, y) -> Sym:
    a, b = (_numeric(_operand(ctx, v)) for v in (x, y))
    if op == "div":
        a, b, type = _cast(a, FLOAT), _cast(b, FLOAT), FLOAT
    else:
        a, b, type = _promote(a, b)
    return Sym(Node(op, type, (a, b)), ctx)


def _integer(ctx, op, x, y) -> Sym:
    a, b = (_numeric(_operand(ctx, v)) for v in (x, y))
    symbol = {"floordiv": "//", "mod": "%"}[op]
    if FLOAT in (a.type, b.type):
        raise ctx.error(TypeError, f"{symbol} takes integer operands (index arithmetic), got "
                                   f"{a.type} {symbol} {b.type}; for floats use / and cuflash.mod's functions")
    if b.op == "const" and b.value == 0:
        raise ctx.error(ZeroDivisionError, f"{symbol} by the constant 0")
    return Sym(Node(op, INT, (a, b)), ctx)


def _pow(ctx, x, exponent) -> Sym:
    if isinstance(exponent, (Sym, SymTensor)) or not isinstance(exponent, numbers.Real) \
            or isinstance(exponent, (bool, np.bool_)):
        raise ctx.error(TypeError, f"** takes a constant real exponent, got {type(exponent).__name__}")
    a = _cast(_numeric(_operand(ctx, x)), FLOAT)
    return Sym(Node("pow", FLOAT, (a,), float(exponent)), ctx)


def _unary(ctx, op, x) -> Sym:
    a = _operand(ctx, x)
    if op == "not":
        if a.type != BOOL:
            raise ctx.error(TypeError, f"~ takes a boolean (a comparison), got {_article(a.type)} ({a.text})")
        return Sym(Node("not", BOOL, (a,)), ctx)
    a = _numeric(a)
    if op in _UNARY_FLOAT:
        a = _cast(a, FLOAT)
    return Sym(Node(op, a.type, (a,)), ctx)


def _compare(ctx, op, x, y) -> Sym:
    a, b = _operand(ctx, x), _operand(ctx, y)
    if not (op in ("eq", "ne") and a.type == b.type == BOOL):
        a, b, _ = _promote(_numeric(a), _numeric(b))
    return Sym(Node(op, BOOL, (a, b)), ctx)


def _logic(ctx, op, x, y) -> Sym:
    a, b = _operand(ctx, x), _operand(ctx, y)
    if a.type != BOOL or b.type != BOOL:
        symbol = {"and": "&", "or": "|"}[op]
        raise ctx.error(TypeError, f"{symbol} takes booleans (comparisons), got {a.type} {symbol} {b.type}")
    return Sym(Node(op, BOOL, (a, b)), ctx)


# -- the functions -----------------------------------------------------------------------------------

def _function(op: str, constant):
    def function(x):
        ctx = _context(x)
        if ctx is None:  # a constant argument: a constant result (IEEE, without warnings)
            with np.errstate(all="ignore"):
                return constant(_plain(x, op))
        return _unary(ctx, op, x)
    function.__name__ = function.__qualname__ = op
    return function


def _plain(x, name):
    if isinstance(x, numbers.Real):
        return x
    raise TypeError(f"cuflash.mod.{name} takes symbolic values or real constants, got {type(x).__name__}")


def _sigmoid(x):
    return float(1 / (1 + np.exp(-np.float64(x))))


exp = _function("exp", lambda x: float(np.exp(np.float64(x))))
log = _function("log", lambda x: float(np.log(np.float64(x))))
tanh = _function("tanh", math.tanh)
sqrt = _function("sqrt", lambda x: float(np.sqrt(np.float64(x))))
sigmoid = _function("sigmoid", _sigmoid)
exp.__doc__ = "e ** x (float)."
log.__doc__ = "The natural logarithm (float; NaN below 0, -inf at 0)."
tanh.__doc__ = "The hyperbolic tangent (float)."
sqrt.__doc__ = "The square root (float; NaN below 0)."
sigmoid.__doc__ = "1 / (1 + exp(-x)) (float)."


def abs(x):
    """|x|, of x's type (int or float)."""
    ctx = _context(x)
    if ctx is None:
        return builtins.abs(_plain(x, "abs"))
    return _unary(ctx, "abs", x)


def _extremum(op: str, plain):
    def function(x, y):
        ctx = _context(x, y)
        if ctx is None:
            return plain(_plain(x, op), _plain(y, op))
        a, b, type = _promote(*(_numeric(_operand(ctx, v)) for v in (x, y)))
        return Sym(Node(op, type, (a, b)), ctx)
    function.__name__ = function.__qualname__ = {"min": "minimum", "max": "maximum"}[op]
    return function


def _plain_extremum(float_function, int_function):
    def extremum(x, y):
        if isinstance(x, numbers.Integral) and isinstance(y, numbers.Integral):
            return int(int_function(x, y))
        return float(float_function(float(x), float(y)))  # (NaN ignored, as for symbols)
    return extremum


minimum = _extremum("min", _plain_extremum(np.fmin, min))
maximum = _extremum("max", _plain_extremum(np.fmax, max))
minimum.__doc__ = "The smaller of x and y (floats: a NaN operand is ignored, as C's fminf)."
maximum.__doc__ = "The larger of x and y (floats: a NaN operand is ignored, as C's fmaxf)."


def where(condition, x, y):
    """x where ``condition`` (a boolean expression) holds, else y; both sides are computed."""
    ctx = _context(condition, x, y)
    if ctx is None:
        return x if condition else y
    c, a, b = (_operand(ctx, v) for v in (condition, x, y))
    if c.type != BOOL:
        raise ctx.error(TypeError, f"where's condition must be a boolean (a comparison), got {_article(c.type)} "
                                   f"({c.text})")
    if not a.type == b.type == BOOL:
        a, b, _ = _promote(_numeric(a), _numeric(b))
    return Sym(Node("where", a.type, (c, a, b)), ctx)


_FUNCTIONS = ("exp", "log", "tanh", "abs", "sqrt", "sigmoid", "minimum", "maximum", "where")


_UFUNCS = {
    "add": lambda x, y: _arith(_context(x, y), "add", x, y),
    "subtract": lambda x, y: _arith(_context(x, y), "sub", x, y),
    "multiply": lambda x, y: _arith(_context(x, y), "mul", x, y),
    "divide": lambda x, y: _arith(_context(x, y), "div", x, y),
    "true_divide": lambda x, y: _arith(_context(x, y), "div", x, y),
    "floor_divide": lambda x, y: _integer(_context(x, y), "floordiv", x, y),
    "remainder": lambda x, y: _integer(_context(x, y), "mod", x, y),
    "power": lambda x, y: _pow(_context(x, y), x, y),
    "negative": lambda x: _unary(_context(x), "neg", x),
    "absolute": abs, "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt,
    "minimum": minimum, "maximum": maximum, "fmin": minimum, "fmax": maximum,
    **{name: (lambda op: lambda x, y: _compare(_context(x, y), op, x, y))(op)
       for name, op in (("less", "lt"), ("less_equal", "le"), ("greater", "gt"), ("greater_equal", "ge"),
                        ("equal", "eq"), ("not_equal", "ne"))},
    "logical_and": lambda x, y: _logic(_context(x, y), "and", x, y),
    "bitwise_and": lambda x, y: _logic(_context(x, y), "and", x, y),
    "logical_or": lambda x, y: _logic(_context(x, y), "or", x, y),
    "bitwise_or": lambda x, y: _logic(_context(x, y), "or", x, y),
    "logical_not": lambda x: _unary(_context(x), "not", x),
    "invert": lambda x: _unary(_context(x), "not", x),
}


# -- tracing -------------------------------------------------------------------------------------

def describe(fn, kind: str) -> str:
    """How messages name a user function: ``score_mod 'name' (file.py:line)``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    name = name.rsplit("<locals>.", 1)[-1]  # (a function defined inside another: its own name)
    code = getattr(fn, "__code__", None)
    where = f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    return f"{kind}_mod {name!r}{where}"


def watched(fn):
    """What a trace of plain function ``fn`` depends on besides its arguments, as a hashable
    value, or None for another kind of callable: its code, its defaults, the values in its
    closure and those of the globals its code names (each beside its type: 1 and 1.0 trace
    to different constants). A call whose functions' ``watched`` is unchanged reuses their
    trace and its compiled kernels (``cuflash._warm.mods_key``); the functions a mod calls
    are watched as objects, not their globals."""
    if not inspect.isfunction(fn):
        return None
    code = fn.__code__
    try:
        closure = tuple((c.cell_contents.__class__, c.cell_contents) for c in fn.__closure__ or ())
    except ValueError:  # (a closure variable not yet assigned: the trace will say)
        return None
    names = fn.__globals__
    return (code, fn.__defaults__, fn.__kwdefaults__, closure,
            tuple((value.__class__, value) for value in map(names.get, code.co_names)))


def _tensor_names(fn, kind: str, count: int) -> list:
    """The parameter names the function gives its mod tensors (None where it takes *args)."""
    names = [None] * count
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fixed = len(SCORE_VARIABLES if kind == "score" else MASK_VARIABLES)
    for i, name in enumerate(positional[fixed:fixed + count]):
        names[i] = name
    return names


def _specs(ctx: _Context, fn, kind: str, mod_tensors) -> tuple:
    if not isinstance(mod_tensors, (tuple, list)):
        raise ctx.error(TypeError, f"mod_tensors must be a tuple of arrays, got {type(mod_tensors).__name__}")
    names = _tensor_names(fn, kind, len(mod_tensors))
    specs = []
    for i, t in enumerate(mod_tensors):
        if isinstance(t, TensorSpec):
            shape, dtype = tuple(t.shape), str(t.dtype)
        elif isinstance(t, np.ndarray):
            shape, dtype = t.shape, t.dtype.name
        else:
            raise ctx.error(TypeError, f"mod_tensors[{i}] must be a NumPy array (the NumPy path), got "
                                       f"{type(t).__module__}.{type(t).__name__}")
        if dtype not in TENSOR_DTYPES:
            raise ctx.error(TypeError, f"mod_tensors[{i}] must have a dtype among {', '.join(TENSOR_DTYPES)}, "
                                       f"got {dtype}")
        specs.append(TensorSpec(i, names[i], tuple(int(n) for n in shape), dtype))
    return tuple(specs)


def trace(fn, kind: str = "score", mod_tensors=()) -> Traced:
    """Call ``fn`` once on symbols and return its checked expression tree.

    kind "score": ``fn(score, b, h, q_idx, kv_idx, *mod_tensors)`` must return a float
    expression; kind "mask": ``fn(b, h, q_idx, kv_idx, *mod_tensors)`` a boolean one.
    ``mod_tensors``: NumPy arrays (or ``TensorSpec``s) of dtype bool, int32, int64, float16,
    bfloat16 (ml_dtypes), float32 or float64; inside ``fn`` each is a symbolic tensor of that shape, indexed by integer
    expressions. Python control flow on a symbolic value, an unsupported operation or a
    return that is not a symbolic value of the right type raises, naming ``fn``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be a function {_SIGNATURES[kind]}, got {fn!r}")
    ctx = _Context(describe(fn, kind))
    specs = _specs(ctx, fn, kind, mod_tensors)
    variables = SCORE_VARIABLES if kind == "score" else MASK_VARIABLES
    args = [Sym(Node("var", FLOAT if v == "score" else INT, value=v), ctx) for v in variables]
    args += [SymTensor(spec, ctx) for spec in specs]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        raise ctx.error(TypeError, f"must take {len(args)} positional arguments {_SIGNATURES[kind]} with "
                                   f"{len(specs)} mod tensor(s)") from None
    except ValueError:  # (no signature to read: the call itself will tell)
        pass
    try:
        result = fn(*args)
    except (TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as error:
        if str(error).startswith(ctx.name):
            raise
        raise ctx.error(type(error), f"failed while traced on symbols: {error}") from error
    if not isinstance(result, Sym):
        raise ctx.error(TypeError, f"must return a symbolic expression built from its arguments, got "
                                   f"{type(result).__name__} {result!r}")
    expected = FLOAT if kind == "score" else BOOL
    if result.node.type != expected:
        what = "a float score" if kind == "score" else "a boolean (False: masked)"
        raise ctx.error(TypeError, f"must return {what}, got {_article(result.node.type)} expression "
                                   f"({result.node.text})")
    return Traced(kind, result.node, specs, ctx.name)


# -- the NumPy printer -----------------------------------------------------------------------------

# (by name: the functions of the array module the evaluator is given, NumPy's or CuPy's)
_NUMPY_UNARY = {"neg": "negative", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt",
                "not": "logical_not"}
_NUMPY_BINARY = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide",
                 "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal", "eq": "equal",
                 "ne": "not_equal", "and": "logical_and", "or": "logical_or"}


def to_numpy(tree: Traced, xp=np):
    """A callable evaluating ``tree`` over NumPy arrays (or, with ``xp`` cupy, CuPy arrays), vectorised:
    ``f(score, b, h, q_idx, kv_idx, *mod_tensors, dtype=None)`` for a score tree,
    ``f(b, h, q_idx, kv_idx, *mod_tensors, dtype=None)`` for a mask tree. The index arguments
    are integer arrays (or ints) that broadcast together; floats are computed in ``dtype``
    (default: score's dtype, else float64), integers in int64. The result broadcasts with the
    arguments. An index out of a mod tensor's range raises IndexError naming the tensor."""
    variables = SCORE_VARIABLES if tree.kind == "score" else MASK_VARIABLES

    def evaluate(*args, dtype=None):
        if len(args) != len(variables) + len(tree.tensors):
            raise TypeError(f"{tree.name}: its NumPy evaluator takes {len(variables)} arguments {variables} and "
                            f"{len(tree.tensors)} mod tensor(s), got {len(args)} arguments")
        values = dict(zip(variables, args))
        if dtype is None:
            score = values.get("score")
            dtype = score.dtype if isinstance(score, np.ndarray) and score.dtype.kind == "f" else np.float64
        for v in variables:
            values[v] = (xp.asarray(values[v], dtype=dtype) if v == "score"
                         else xp.asarray(values[v]).astype(np.int64, copy=False))
        tensors = args[len(variables):]
        for spec, t in zip(tree.tensors, tensors):
            if not isinstance(t, xp.ndarray) or t.shape != spec.shape or t.dtype.name != spec.dtype:
                raise TypeError(f"{tree.name}: mod tensor {spec.label} was traced as {spec.dtype} {spec.shape}, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} {getattr(t, 'shape', '')}")
        with np.errstate(all="ignore"):  # IEEE results without warnings, as on the GPU
            return _NumpyEvaluator(tree, values, tensors, np.dtype(dtype).type, xp).value(tree.root)

    evaluate.__name__ = evaluate.__qualname__ = f"{tree.kind}_mod_numpy"
    evaluate.__doc__ = f"NumPy evaluation of {tree.name}: {tree.text}"
    return evaluate


class _NumpyEvaluator:
    def __init__(self, tree: Traced, values: dict, tensors: tuple, dtype, xp=np):
        self.tree, self.values, self.tensors, self.dtype, self.xp = tree, values, tensors, dtype, xp
        self.memo = {}

    def value(self, node: Node):
        result = self.memo.get(node)
        if result is None:
            result = self.memo[node] = self._compute(node)
        return result

    def _compute(self, node: Node):
        op, dtype, xp = node.op, self.dtype, self.xp
        if op == "var":
            return self.values[node.value]
        if op == "const":
            return {FLOAT: dtype, INT: np.int64, BOOL: np.bool_}[node.type](node.value)
        if op == "load":
            return self._load(node)
        args = [self.value(a) for a in node.args]
        if op == "cast":
            return xp.asarray(args[0]).astype({FLOAT: dtype, INT: np.int64}[node.type])
        if op in _NUMPY_UNARY:
            return getattr(xp, _NUMPY_UNARY[op])(args[0])
        if op == "sigmoid":
            return dtype(1) / (dtype(1) + xp.exp(-args[0]))
        if op == "pow":
            return args[0] * args[0] if node.value == 2 else xp.power(args[0], dtype(node.value))
        if op in _NUMPY_BINARY:
            return getattr(xp, _NUMPY_BINARY[op])(*args)
        if op in ("floordiv", "mod"):
            if xp.any(xp.asarray(args[1]) == 0):
                raise ZeroDivisionError(f"{self.tree.name}: integer {'//' if op == 'floordiv' else '%'} by zero "
                                        f"({node.args[1].text} is 0)")
            return (xp.floor_divide if op == "floordiv" else xp.remainder)(*args)
        if op in ("min", "max"):
            if node.type == FLOAT:
                return (xp.fmin if op == "min" else xp.fmax)(*args)
            return (xp.minimum if op == "min" else xp.maximum)(*args)
        if op == "where":
            return xp.where(*args)
        raise AssertionError(f"unknown node {op}")

    def _load(self, node: Node):
        position = node.value[0]
        tensor, spec = self.tensors[position], self.tree.tensors[position]
        indices = [self.xp.asarray(self.value(a)) for a in node.args]
        # Checked before the gather: NumPy would wrap a negative index around silently.
        for axis, (index, size) in enumerate(zip(indices, tensor.shape)):
            if index.size and (index.min() < 0 or index.max() >= size):
                raise IndexError(f"{self.tree.name}: index {axis} of mod tensor {spec.label} (shape {spec.shape}) "
                                 f"must be in [0, {size}), got values from {int(index.min())} to {int(index.max())} "
                                 f"({node.args[axis].text})")
        gathered = tensor[tuple(indices)]
        return self.xp.asarray(gathered).astype({FLOAT: self.dtype, INT: np.int64, BOOL: np.bool_}[node.type],
                                                copy=False)


# -- the CUDA printer -------------------------------------------------------------------------------

_CUDA_TYPES = {FLOAT: "float", INT: "int", BOOL: "bool"}
_CUDA_POINTERS = {"bool": "bool", "int32": "int", "int64": "long long", "float16": "unsigned short",
                  "bfloat16": "unsigned short", "float32": "float", "float64": "double"}
_CUDA_FLOAT_FUNCTIONS = {"exp": "expf", "log": "logf", "tanh": "tanhf", "sqrt": "sqrtf", "abs": "fabsf"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _cuda_float(value: float) -> str:
    with np.errstate(over="ignore"):  # (beyond float32's range is inf, as on the GPU)
        value = float(np.float32(value))
    if math.isnan(value):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(value):
        return "__int_as_float(0x7f800000)" if value > 0 else "__int_as_float(0xff800000)"
    text = f"{value:.9g}"  # 9 significant digits name a float32 exactly
    if not any(c in text for c in ".en"):
        text += ".0"
    return f"({text}f)" if text.startswith("-") else f"{text}f"


def to_cuda(tree: Traced, name: str) -> str:
    """The text of a ``__device__ __forceinline__`` CUDA function ``name`` computing ``tree``:
    ``float name(float score, int b, int h, int q_idx, int kv_idx, <tensors>)`` for a score
    tree, ``bool name(int b, int h, int q_idx, int kv_idx, <tensors>)`` for a mask tree. Each
    mod tensor is a pointer ``t<i>`` (float16 and bfloat16 as their 16 bits), its element
    strides ``t<i>_stride<axis>`` (long long) and its sizes ``t<i>_size<axis>`` (int); each
    index is clamped into [0, size) (a tile's rows and columns past the sequence's ends read
    the edge; callers check the indices of the real positions up front: ``index_ranges``).
    Floats are float (expf, logf, tanhf, ...), integers int, booleans bool; it includes no header."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"name must be a C identifier, got {name!r}")
    variables = SCORE_VARIABLES if tree.kind == "score" else MASK_VARIABLES
    parameters = [f"const {'float' if v == 'score' else 'int'} {v}" for v in variables]
    for spec in tree.tensors:
        parameters.append(f"const {_CUDA_POINTERS[spec.dtype]}* __restrict__ t{spec.position}")
        parameters += [f"const long long t{spec.position}_stride{axis}" for axis in range(len(spec.shape))]
        parameters += [f"const int t{spec.position}_size{axis}" for axis in range(len(spec.shape))]
    printer = _CudaPrinter()
    result = printer.expression(tree.root)
    result_type = "float" if tree.kind == "score" else "bool"
    lines = [f"// {tree.name}: {tree.text}",
             f"__device__ __forceinline__ {result_type} {name}({', '.join(parameters)})",
             "{",
             *(f"    {line}" for line in printer.lines),
             f"    return {result};",
             "}"]
    return "\n".join(lines) + "\n"


class _CudaPrinter:
    """Straight-line code: one const local per node (equal subtrees computed once)."""

    def __init__(self):
        self.lines, self.names = [], {}

    def local(self, type: str, text: str) -> str:
        name = f"v{len(self.lines)}"
        self.lines.append(f"const {_CUDA_TYPES[type]} {name} = {text};")
        return name

    def expression(self, node: Node) -> str:
        if node.op == "var":
            return node.value
        if node.op == "const":
            if node.type == FLOAT:
                return _cuda_float(node.value)
            if node.type == BOOL:
                return "true" if node.value else "false"
            return f"({node.value})" if node.value < 0 else str(node.value)
        name = self.names.get(node)
        if name is None:
            name = self.names[node] = self._emit(node)
        return name

    def _emit(self, node: Node) -> str:
        op, type = node.op, node.type
        if op == "load":
            position, dtype, _ = node.value
            indices = [self.local(INT, f"min(max({self.expression(a)}, 0), t{position}_size{axis} - 1)")
                       for axis, a in enumerate(node.args)]
            offset = " + ".join(f"(long long){index} * t{position}_stride{axis}"
                                for axis, index in enumerate(indices)) or "0"
            value = f"t{position}[{offset}]"
            if dtype == "float16":  # (no header: the conversion in PTX)
                name = f"v{len(self.lines)}"
                self.lines.append(f"float {name};")
                self.lines.append(f'asm("cvt.f32.f16 %0, %1;" : "=f"({name}) : "h"({value}));')
                return name
            if dtype == "bfloat16":  # bfloat16 is a float32's upper half
                value = f"__uint_as_float((unsigned){value} << 16)"
            elif dtype in ("int64", "float64"):
                value = f"({_CUDA_TYPES[type]}){value}"
            return self.local(type, value)
        args = [self.expression(a) for a in node.args]
        if op == "cast":
            return self.local(type, f"({_CUDA_TYPES[type]}){args[0]}")
        if op == "neg":
            return self.local(type, f"-{args[0]}")
        if op == "not":
            return self.local(type, f"!{args[0]}")
        if op == "abs" and type == INT:
            return self.local(type, f"abs({args[0]})")
        if op in _CUDA_FLOAT_FUNCTIONS:
            return self.local(type, f"{_CUDA_FLOAT_FUNCTIONS[op]}({args[0]})")
        if op == "sigmoid":
            return self.local(type, f"1.0f / (1.0f + expf(-{args[0]}))")
        if op == "pow":
            if node.value == 2:
                return self.local(type, f"{args[0]} * {args[0]}")
            return self.local(type, f"powf({args[0]}, {_cuda_float(node.value)})")
        if op in _ARITHMETIC:
            return self.local(type, f"{args[0]} {_ARITHMETIC[op]} {args[1]}")
        if op in _COMPARISONS:
            return self.local(type, f"{args[0]} {_COMPARISONS[op]} {args[1]}")
        if op in ("and", "or"):
            return self.local(type, f"{args[0]} {'&&' if op == 'and' else '||'} {args[1]}")
        if op in ("floordiv", "mod"):
            # C rounds toward zero; Python (and this tree) toward minus infinity.
            a, b = args
            quotient, remainder = self.local(INT, f"{a} / {b}"), self.local(INT, f"{a} % {b}")
            off = self.local(BOOL, f"{remainder} != 0 && (({remainder} < 0) != ({b} < 0))")
            if op == "floordiv":
                return self.local(INT, f"{off} ? {quotient} - 1 : {quotient}")
            return self.local(INT, f"{off} ? {remainder} + {b} : {remainder}")
        if op in ("min", "max"):
            function = {FLOAT: "fminf", INT: "min"}[type] if op == "min" else {FLOAT: "fmaxf", INT: "max"}[type]
            return self.local(type, f"{function}({args[0]}, {args[1]})")
        if op == "where":
            return self.local(type, f"{args[0]} ? {args[1]} : {args[2]}")
        raise AssertionError(f"unknown node {op}")


MAX_KERNEL_TENSORS = 8  # mod tensors a kernel takes (cuda/mods.cuh, kMaxModTensors)
MAX_KERNEL_DIMS = 4     # dimensions of each (ModTensor)


def kernel_source(score: Traced | None, mask: Traced | None, blocks: bool = False) -> str:
    """The CUDA text the kernels of a call with mods compile with: score_mod, its derivative
    and mask_mod as device functions, and ``cuflash::UserMods``, the struct the kernels call
    them through (cuda/mods.cuh describes its interface; ``NoMods`` is the struct of the
    kernels without mods). ``blocks``: the call has a block mask (``BlockMask``), and the
    kernels skip its empty tiles and its full tiles' mask_mod. The text names each
    function's tree, so it keys the kernels' cache: equal trees share their kernels,
    whatever the tensors' shapes."""
    trees = [t for t in (score, mask) if t is not None]
    if not trees:
        raise ValueError("kernel_source needs a score or a mask tree")
    if blocks and mask is None:
        raise ValueError("a block mask comes with its mask_mod's tree")
    specs = trees[0].tensors
    if len(specs) > MAX_KERNEL_TENSORS or any(len(t.shape) > MAX_KERNEL_DIMS for t in specs):
        raise ValueError(f"the kernels take at most {MAX_KERNEL_TENSORS} mod tensors of at most {MAX_KERNEL_DIMS} "
                         f"dimensions each")
    arguments = []
    for spec in specs:
        i, axes = spec.position, range(len(spec.shape))
        arguments.append(f"static_cast<const {_CUDA_POINTERS[spec.dtype]}*>(t[{i}].ptr)")
        arguments += [f"t[{i}].stride[{axis}]" for axis in axes]
        arguments += [f"t[{i}].size[{axis}]" for axis in axes]
    tail = "".join(f", {a}" for a in arguments)
    lines, members = [], [f"  static constexpr bool kScore = {str(score is not None).lower()}, "
                          f"kMask = {str(mask is not None).lower()}, kBlocks = {str(bool(blocks)).lower()};"]
    method = "  template <typename Tensor>\n  static __device__ __forceinline__ {} {}({}, const Tensor* t) {{ return {}({}{}); }}"
    score_args = "float score, int b, int h, int q_idx, int kv_idx"
    if score is not None:
        lines += [to_cuda(score, "cuflash_score_mod"), to_cuda(derivative(score), "cuflash_score_mod_gradient")]
        members += [method.format("float", "score", score_args, "cuflash_score_mod",
                                  "score, b, h, q_idx, kv_idx", tail),
                    method.format("float", "gradient", score_args, "cuflash_score_mod_gradient",
                                  "score, b, h, q_idx, kv_idx", tail)]
    if mask is not None:
        lines.append(to_cuda(mask, "cuflash_mask_mod"))
        members.append(method.format("bool", "mask", "int b, int h, int q_idx, int kv_idx", "cuflash_mask_mod",
                                     "b, h, q_idx, kv_idx", tail))
    lines += ["namespace cuflash {", "struct UserMods {", *members, "};", "}  // namespace cuflash", ""]
    return "\n".join(lines)


def index_ranges(tree: Traced, domain: dict) -> None:
    """Check a tree's integer arithmetic over the positions of a call before the kernels run:
    ``domain`` maps b, h, q_idx and kv_idx to their (lowest, highest) values. Raises
    IndexError where an index into a mod tensor can leave the tensor (as the NumPy path
    raises at the first such value), ValueError where integer arithmetic can leave int32
    (the GPU's). Interval arithmetic: an index computed from a mod tensor's values cannot
    be bounded and is clamped into the tensor by the kernels instead."""
    memo: dict = {}

    def interval(node: Node):
        if node in memo:
            return memo[node]
        result = memo[node] = _interval(node, interval, domain)
        if node.type == INT and result is not None and not -INT32_LIMIT <= result[0] <= result[1] < INT32_LIMIT:
            raise ValueError(f"{tree.name}: integer arithmetic ({node.text}) reaches {result[0]} .. {result[1]} "
                             f"over this call's positions, beyond int32, the type of index arithmetic on the GPU")
        return result

    def visit(node: Node, seen: set):
        if node in seen:
            return
        seen.add(node)
        for a in node.args:
            visit(a, seen)
        interval(node)
        if node.op != "load":
            return
        spec = tree.tensors[node.value[0]]
        for axis, (index, size) in enumerate(zip(node.args, spec.shape)):
            bounds = interval(index)
            if bounds is not None and (bounds[0] < 0 or bounds[1] >= size):
                raise IndexError(f"{tree.name}: index {axis} of mod tensor {spec.label} (shape {spec.shape}) must be "
                                 f"in [0, {size}), got values from {bounds[0]} to {bounds[1]} over this call's "
                                 f"positions ({index.text})")

    visit(tree.root, set())


def _interval(node: Node, interval, domain: dict):
    """(lowest, highest) of an integer or boolean node, or None where unknown."""
    op = node.op
    if node.type == BOOL:
        return (0, 1)
    if node.type != INT:
        return None
    if op == "var":
        return domain[node.value]
    if op == "const":
        return (node.value, node.value)
    if op == "load":
        return None
    args = [interval(a) for a in node.args]
    if op == "cast":
        return args[0]
    if op == "where":
        args = args[1:]
    if any(a is None for a in args):
        return None
    if op == "neg":
        return (-args[0][1], -args[0][0])
    if op == "abs":
        lo, hi = args[0]
        return (0 if lo <= 0 <= hi else min(builtins.abs(lo), builtins.abs(hi)), max(builtins.abs(lo), builtins.abs(hi)))
    (a0, a1), (b0, b1) = args[0], args[1]
    if op == "add":
        return (a0 + b0, a1 + b1)
    if op == "sub":
        return (a0 - b1, a1 - b0)
    if op == "mul":
        corners = (a0 * b0, a0 * b1, a1 * b0, a1 * b1)
        return (min(corners), max(corners))
    if op in ("min", "max"):
        f = min if op == "min" else max
        return (f(a0, b0), f(a1, b1))
    if op == "where":
        return (min(a0, b0), max(a1, b1))
    if op in ("floordiv", "mod") and b0 == b1 and b0 != 0:  # a constant divisor
        if op == "mod":
            return (0, b0 - 1) if b0 > 0 else (b0 + 1, 0)
        corners = (a0 // b0, a1 // b0)
        return (min(corners), max(corners))
    return None


# -- the derivative ---------------------------------------------------------------------------------

_FOLDS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def _folding(op: str):
    """``a op b`` by the decorated rule (its simplifications), once two constants are folded in
    double precision (the derivative's c * (c - 1) and such; never a division by zero)."""
    def decorate(rule):
        @functools.wraps(rule)
        def node(a: Node, b: Node) -> Node:
            if a.op == "const" and b.op == "const" and not (op == "div" and b.value == 0):
                return _const(_FOLDS[op](a.value, b.value))
            return rule(a, b)
        return node
    return decorate


@_folding("add")
def _add(a: Node, b: Node) -> Node:
    if a == _ZERO:
        return b
    return a if b == _ZERO else Node("add", FLOAT, (a, b))


@_folding("sub")
def _sub(a: Node, b: Node) -> Node:
    if b == _ZERO:
        return a
    return _neg(b) if a == _ZERO else Node("sub", FLOAT, (a, b))


@_folding("mul")
def _mul(a: Node, b: Node) -> Node:
    if a == _ZERO or b == _ZERO:
        return _ZERO
    if a == _ONE:
        return b
    return a if b == _ONE else Node("mul", FLOAT, (a, b))


@_folding("div")
def _div(a: Node, b: Node) -> Node:
    return _ZERO if a == _ZERO else Node("div", FLOAT, (a, b))


def _neg(a: Node) -> Node:
    return _ZERO if a == _ZERO else Node("neg", FLOAT, (a,))


def _choose(condition: Node, a: Node, b: Node) -> Node:
    return a if a == b else Node("where", FLOAT, (condition, a, b))


def derivative(tree: Traced) -> Traced:
    """The tree of d score_mod / d score: the chain rule over every operation; where, minimum,
    maximum and abs piecewise (minimum and maximum follow the argument they return: the first
    on a tie; abs's derivative is 0 at 0); integers, booleans, comparisons and mod tensors
    have none."""
    if tree.kind != "score":
        raise ValueError(f"derivative takes a score_mod's tree, got a {tree.kind} tree ({tree.name})")
    memo: dict = {}

    def d(node: Node) -> Node:
        result = memo.get(node)
        if result is None:
            result = memo[node] = _derive(node, d)
        return result

    return Traced("score", d(tree.root), tree.tensors, tree.name)


def _derive(node: Node, d) -> Node:
    op = node.op
    if node.type != FLOAT or op in ("const", "load", "cast"):
        return _ZERO
    if op == "var":
        return _ONE if node.value == "score" else _ZERO
    x = node.args[0]
    if op == "neg":
        return _neg(d(x))
    if op == "abs":
        dx = d(x)
        if dx == _ZERO:
            return _ZERO
        inner = _choose(Node("lt", BOOL, (x, _ZERO)), _neg(dx), _ZERO)
        return _choose(Node("gt", BOOL, (x, _ZERO)), dx, inner)
    if op == "exp":
        return _mul(node, d(x))
    if op == "log":
        return _div(d(x), x)
    if op == "tanh":
        return _mul(_sub(_ONE, _mul(node, node)), d(x))
    if op == "sqrt":
        return _div(d(x), _mul(_const(2.0), node))
    if op == "sigmoid":
        return _mul(_mul(node, _sub(_ONE, node)), d(x))
    if op == "pow":
        c = node.value
        if c == 0:
            return _ZERO
        power = x if c - 1 == 1 else _ONE if c - 1 == 0 else Node("pow", FLOAT, (x,), c - 1)
        return _mul(_mul(_const(c), power), d(x))
    if op == "where":
        return _choose(node.args[0], d(node.args[1]), d(node.args[2]))
    a, b = node.args
    if op == "add":
        return _add(d(a), d(b))
    if op == "sub":
        return _sub(d(a), d(b))
    if op == "mul":
        return _add(_mul(d(a), b), _mul(a, d(b)))
    if op == "div":  # d(a / b) = (da - (a / b) db) / b
        return _div(_sub(d(a), _mul(node, d(b))), b)
    if op in ("min", "max"):  # the side fminf / fmaxf return: a on a tie or where b is NaN
        first = Node("or", BOOL, (Node("le" if op == "min" else "ge", BOOL, (a, b)), Node("ne", BOOL, (b, b))))
        return _choose(first, d(a), d(b))
    raise AssertionError(f"no derivative for {op}")


# -- the NumPy backends' view --------------------------------------------------------------------------

class NumpyModifiers:
    """score_mod and mask_mod of one call, traced and bound to their NumPy tensors: what the
    NumPy path and the float64 oracle apply to a block of scores. Index arguments are
    arrays that broadcast against the block (b: the global batch or sequence index, h: the
    query head)."""

    def __init__(self, score: Traced | None, mask: Traced | None, tensors: tuple, backward: bool):
        self.tensors = tensors
        self._score = None if score is None else to_numpy(score)
        self._gradient = None if score is None or not backward else to_numpy(derivative(score))
        self._mask = None if mask is None else to_numpy(mask)

    def score(self, s, b, h, q_idx, kv_idx):
        """score_mod over the block s (s's dtype and shape), or s itself without one."""
        if self._score is None:
            return s
        return np.broadcast_to(self._score(s, b, h, q_idx, kv_idx, *self.tensors, dtype=s.dtype), s.shape)

    def gradient(self, s, b, h, q_idx, kv_idx):
        """d score_mod / d score at the block s (the scores before score_mod), or None."""
        if self._gradient is None:
            return None
        return np.broadcast_to(self._gradient(s, b, h, q_idx, kv_idx, *self.tensors, dtype=s.dtype), s.shape)

    def mask(self, b, h, q_idx, kv_idx, dtype):
        """mask_mod's booleans (broadcasting against the block), or None without one."""
        if self._mask is None:
            return None
        return self._mask(b, h, q_idx, kv_idx, *self.tensors, dtype=dtype)


def prepare(score_mod, mask_mod, mod_tensors=(), *, backward: bool = False) -> NumpyModifiers | None:
    """Trace score_mod and mask_mod (either may be None) over NumPy ``mod_tensors``; None
    when neither is given. ``backward`` also builds score_mod's derivative."""
    if score_mod is None and mask_mod is None:
        if isinstance(mod_tensors, (tuple, list)) and not mod_tensors:
            return None
        raise ValueError("mod_tensors are the extra arguments of score_mod and mask_mod: pass one of them too")
    score = None if score_mod is None else trace(score_mod, "score", mod_tensors)
    mask = None if mask_mod is None else trace(mask_mod, "mask", mod_tensors)
    for i, t in enumerate(mod_tensors):
        if not isinstance(t, np.ndarray):  # (trace also takes TensorSpecs, which hold no values)
            name = describe(score_mod, "score") if score_mod is not None else describe(mask_mod, "mask")
            raise TypeError(f"{name}: mod_tensors[{i}] must be a NumPy array (the NumPy path), got "
                            f"{type(t).__name__}")
    return NumpyModifiers(score, mask, tuple(mod_tensors), backward)


# -- block masks ------------------------------------------------------------------------------------

BLOCK_SIZE = 128  # query rows and keys of a block (cuda/mods.cuh, kBlockMaskSize)
EMPTY, PARTIAL, FULL = 0, 1, 2  # a block's status: every position masked, some, none
EVALUATED_POSITIONS = 1 << 22  # positions create_block_mask evaluates at once (its memory: a few bytes each)


class BlockMask:
    """Which 128 x 128 blocks of (query, key) positions a ``mask_mod`` hides entirely, shows
    entirely or cuts through, computed once (``create_block_mask``) and passed to every call
    of those shapes (``cuflash.attention(..., block_mask=...)``): the kernels never load the
    tiles of an empty block and skip mask_mod in a full one. Immutable.

    ``mask_mod`` and ``mod_tensors``: the mask and its tensors, which a call with this block
    mask uses (the mask's tree is ``tree``). ``statuses``: int8 (batch or 1, heads or 1,
    ceil(seqlen_q / 128), ceil(seqlen_k / 128)) of EMPTY (0), PARTIAL (1) and FULL (2), an
    array of ``like``'s kind on its device (NumPy, CuPy, PyTorch or JAX); a dimension is 1
    where the mask does not depend on b (or h), and the statuses broadcast over it. ``batch``
    and ``heads``: the sizes it was made for (None: any). The statuses are a snapshot of the
    mask over the mod tensors' values at creation: make a new block mask after changing those
    values."""
    __slots__ = ("mask_mod", "mod_tensors", "tree", "statuses", "batch", "heads", "seqlen_q", "seqlen_k")

    def __init__(self, mask_mod, mod_tensors: tuple, tree: Traced, statuses, batch, heads, seqlen_q: int,
                 seqlen_k: int):
        for name, value in (("mask_mod", mask_mod), ("mod_tensors", tuple(mod_tensors)), ("tree", tree),
                            ("statuses", statuses), ("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q),
                            ("seqlen_k", seqlen_k)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("a BlockMask is immutable: make a new one with create_block_mask")

    @property
    def shape(self) -> tuple:
        """The statuses' shape."""
        return tuple(self.statuses.shape)

    def __repr__(self):
        return (f"BlockMask({self.tree.name}, batch={self.batch}, heads={self.heads}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, statuses {_kind(self.statuses) or type(self.statuses).__name__} int8"
                f"{list(self.shape)})")


class _Where(NamedTuple):
    """Where create_block_mask evaluates a mask: with ``xp`` (NumPy, or CuPy on the GPU
    ``device``), for arrays of ``kind`` ("numpy", "cupy", "torch" or "jax"), which the mod
    tensors are and the statuses become."""
    kind: str
    xp: object
    device: int | None


_KIND_NAMES = {"numpy": "a numpy array", "cupy": "a cupy array", "torch": "a torch tensor", "jax": "a jax array"}
_DLPACK_CPU = 1  # kDLCPU in DLPack's DLDeviceType


def _kind(x) -> str | None:
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.split(".")[0]
    return {"cupy": "cupy", "torch": "torch", "jax": "jax", "jaxlib": "jax"}.get(root)


def _where(like) -> _Where:
    """NumPy for None or a NumPy array (or a CPU tensor, a CPU JAX array); CuPy on the GPU
    of a CuPy array, a CUDA tensor or a GPU JAX array."""
    kind = "numpy" if like is None else _kind(like)
    if kind is None:
        raise TypeError(f"like must be None, a NumPy array, a CuPy array, a torch tensor or a JAX array (the calls' "
                        f"kind: where the statuses are computed and kept), got "
                        f"{type(like).__module__}.{type(like).__name__}")
    if kind == "jax" and _traced(like):
        raise TypeError("like is a traced JAX array: create_block_mask evaluates the mask on concrete arrays; "
                        "call it outside jax.jit and pass the BlockMask in (its arrays are inputs)")
    if kind == "numpy" or like.__dlpack_device__()[0] == _DLPACK_CPU:
        return _Where(kind, np, None)
    import cupy
    return _Where(kind, cupy, int(like.__dlpack_device__()[1]))


def _traced(x) -> bool:
    import jax
    return isinstance(x, jax.core.Tracer)


def _evaluable(tensors: tuple, where: _Where, name: str) -> tuple:
    """The mod tensors as NumPy or CuPy arrays on ``where``'s device, without a copy."""
    views = []
    for i, t in enumerate(tensors):
        if _kind(t) != where.kind:
            like = "is None or a NumPy array" if where.kind == "numpy" else f"is {_KIND_NAMES[where.kind]}"
            raise TypeError(f"{name}: mod_tensors[{i}] must be {_KIND_NAMES[where.kind]} (like {like}), got "
                            f"{type(t).__module__}.{type(t).__name__}")
        if where.kind in ("numpy", "cupy"):
            views.append(t)
            continue
        if where.kind == "jax" and _traced(t):
            raise TypeError(f"{name}: mod_tensors[{i}] is a traced JAX array: create_block_mask evaluates the mask "
                            f"on concrete arrays; call it outside jax.jit")
        try:
            device_type, device = t.__dlpack_device__()
            device = None if device_type == _DLPACK_CPU else int(device)
            view = where.xp.from_dlpack(t.detach() if where.kind == "torch" else t) if device == where.device else None
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            raise TypeError(f"{name}: mod_tensors[{i}] ({_KIND_NAMES[where.kind]} of dtype {t.dtype}) cannot be "
                            f"read by {where.xp.__name__}: {e}") from None
        if view is None:
            raise ValueError(f"{name}: mod_tensors[{i}] must be on like's device ({_device_name(where.device)}), "
                             f"got {_device_name(device)}")
        views.append(view)
    return tuple(views)


def _device_name(device: int | None) -> str:
    return "cpu" if device is None else f"cuda:{device}"


def _as_kind(statuses, where: _Where):
    """The statuses (NumPy or CuPy) as an array of ``where``'s kind, without a copy."""
    if where.kind in ("torch", "jax") and where.device is not None:
        where.xp.cuda.get_current_stream().synchronize()  # (written: whatever stream the framework reads on)
    if where.kind == "torch":
        import torch
        return torch.from_dlpack(statuses)
    if where.kind == "jax":
        import jax.dlpack
        return jax.dlpack.from_dlpack(statuses)
    return statuses


def _uses(tree: Traced, variable: str) -> bool:
    seen, stack = set(), [tree.root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "var" and node.value == variable:
            return True
        stack.extend(node.args)
    return False


def _size(name: str, value, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < 0 \
            or (optional and value == 0) or value >= INT32_LIMIT:
        what = "a positive integer or None (any: the mask must not depend on it)" if optional \
            else "an integer in [0, 2**31)"
        raise (TypeError if not isinstance(value, numbers.Integral) else ValueError)(
            f"{name} must be {what}, got {value!r}")
    return int(value)


def create_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, *, mod_tensors=(), like=None) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx, *mod_tensors) -> bool`` over
    ``batch`` x ``heads`` (query heads) x ``seqlen_q`` x ``seqlen_k`` positions, exact: the
    mask is evaluated at every position (through its traced tree, chunk by chunk), and a
    block is EMPTY where it hides every position of the block, FULL where it hides none,
    PARTIAL otherwise. ``batch`` or ``heads`` None: any, for a mask that does not read b (or
    h). ``like``: an array of the kind and on the device of the calls' q, which the mod
    tensors must be too, and the statuses become: None or a NumPy array (computed with
    NumPy), a CuPy array (computed on its GPU), a torch tensor or a JAX array (computed with
    NumPy on the CPU, with CuPy on a GPU, through zero-copy DLPack views). Build it once and
    pass it to every call (every layer) of those shapes and that mask."""
    where = _where(like)
    batch, heads = _size("batch", batch, optional=True), _size("heads", heads, optional=True)
    seqlen_q, seqlen_k = _size("seqlen_q", seqlen_q, optional=False), _size("seqlen_k", seqlen_k, optional=False)
    if not isinstance(mod_tensors, (tuple, list)):
        raise TypeError(f"mod_tensors must be a tuple of arrays (mask_mod's extra arguments), got "
                        f"{type(mod_tensors).__name__}")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function {_SIGNATURES['mask']}, got {mask_mod!r}")
    # (on like's GPU, whichever is current: the views are ordered on its current stream)
    with contextlib.nullcontext() if where.device is None else where.xp.cuda.Device(where.device):
        views = _evaluable(tuple(mod_tensors), where, describe(mask_mod, "mask"))
        specs = tuple(TensorSpec(i, None, tuple(int(n) for n in t.shape), t.dtype.name) for i, t in enumerate(views))
        tree = trace(mask_mod, "mask", specs)
        for name, size, variable in (("batch", batch, "b"), ("heads", heads, "h")):
            if size is None and _uses(tree, variable):
                raise ValueError(f"{tree.name} reads {variable}: give create_block_mask its {name}, not None")
        # (a dimension the mask does not read is evaluated once: the statuses broadcast over it)
        shape = (batch if _uses(tree, "b") else None, heads if _uses(tree, "h") else None, seqlen_q, seqlen_k)
        statuses = _as_kind(_statuses(tree, views, where.xp, *shape), where)
    return BlockMask(mask_mod, tuple(mod_tensors), tree, statuses, batch, heads, seqlen_q, seqlen_k)


def _statuses(tree: Traced, tensors: tuple, xp, batch, heads, seqlen_q: int, seqlen_k: int):
    """The int8 statuses (batch or 1, heads or 1, query blocks, key blocks), the mask
    evaluated over every position, a batch element, some heads and some query blocks at a time."""
    evaluate = to_numpy(tree, xp)
    batches, all_heads = batch or 1, heads or 1
    query_blocks, key_blocks = -(-seqlen_q // BLOCK_SIZE), -(-seqlen_k // BLOCK_SIZE)
    statuses = xp.empty((batches, all_heads, query_blocks, key_blocks), dtype=np.int8)
    if not statuses.size:
        return statuses
    keys = key_blocks * BLOCK_SIZE
    heads_at_once = max(1, min(all_heads, EVALUATED_POSITIONS // (BLOCK_SIZE * keys)))
    rows_at_once = max(1, EVALUATED_POSITIONS // (heads_at_once * BLOCK_SIZE * keys)) * BLOCK_SIZE
    # Positions a block holds (the last row and column of blocks may be cut short).
    row_sizes = np.minimum(BLOCK_SIZE, seqlen_q - BLOCK_SIZE * np.arange(query_blocks))
    col_sizes = np.minimum(BLOCK_SIZE, seqlen_k - BLOCK_SIZE * np.arange(key_blocks))
    sizes = xp.asarray(row_sizes[:, None] * col_sizes[None, :])
    kv_idx = xp.arange(seqlen_k).reshape(1, 1, 1, -1)
    for b in range(batches):
        for h0 in range(0, all_heads, heads_at_once):
            h = xp.arange(h0, min(h0 + heads_at_once, all_heads)).reshape(1, -1, 1, 1)
            for r0 in range(0, seqlen_q, rows_at_once):
                r1 = min(r0 + rows_at_once, seqlen_q)
                q_idx = xp.arange(r0, r1).reshape(1, 1, -1, 1)
                shown = xp.asarray(evaluate(xp.asarray(b).reshape(1, 1, 1, 1), h, q_idx, kv_idx, *tensors))
                blocks = -(-(r1 - r0) // BLOCK_SIZE)
                padded = xp.zeros((h.shape[1], blocks * BLOCK_SIZE, keys), dtype=np.int32)
                padded[:, :r1 - r0, :seqlen_k] = xp.broadcast_to(shown, (1, h.shape[1], r1 - r0, seqlen_k))[0]
                counts = padded.reshape(h.shape[1], blocks, BLOCK_SIZE, key_blocks, BLOCK_SIZE).sum(axis=(2, 4))
                full = sizes[r0 // BLOCK_SIZE:r0 // BLOCK_SIZE + blocks]
                statuses[b, h0:h0 + h.shape[1], r0 // BLOCK_SIZE:r0 // BLOCK_SIZE + blocks] = \
                    xp.where(counts == 0, EMPTY, xp.where(counts == full, FULL, PARTIAL)).astype(np.int8)
    return statuses
