"""The tests and the developer scripts reach into the package through public names only: none
assigns a module's underscore-named attribute (``module._name = ...``, ``setattr(x, "_name", ...)``,
``monkeypatch.setattr(x, "_name", ...)``). A seam a test needs is a public, documented name of
its module, so that a rename inside the package cannot leave a test patching a name nothing reads."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("tests", "scripts")
SETTERS = {"setattr", "delattr"}  # (setattr(x, name, ...), monkeypatch.setattr(x, name, ...), and the same to delete)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain (``a.b.c``) starts from, or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.expr) -> str:
    return ast.unparse(node)


class _Writes(ast.NodeVisitor):
    """The writes of one file to a module's private attributes: (line, text) each."""

    def __init__(self, tree: ast.Module):
        self.found: list[tuple[int, str]] = []
        self.classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.modules: set[str] = set()  # names bound to an imported module (or to a name imported from one)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                self.modules |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and _dotted(node.value.func).endswith("import_module"):
                self.modules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.modules -= self.classes | {"self", "cls"}

    def _owner_exempt(self, owner: ast.expr) -> bool:
        return isinstance(owner, ast.Name) and owner.id in self.classes | {"self", "cls"}

    def _target(self, target: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._target(element)
        elif isinstance(target, ast.Starred):
            self._target(target.value)
        elif isinstance(target, ast.Attribute) and _private(target.attr) and _root(target.value) in self.modules \
                and not self._owner_exempt(target.value):
            self.found.append((target.lineno, _dotted(target)))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in SETTERS and node.args:
            first = node.args[0]
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                if _private(node.args[1].value) and not self._owner_exempt(first):
                    self.found.append((node.lineno, f"{name}({_dotted(first)}, {node.args[1].value!r})"))
            elif isinstance(first, ast.Constant) and isinstance(first.value, str) \
                    and _private(first.value.rsplit(".", 1)[-1]):  # monkeypatch.setattr("package.module._name", ...)
                self.found.append((node.lineno, f"{name}({first.value!r})"))
        self.generic_visit(node)


def _scripts(tree: ast.Module) -> list[tuple[int, ast.Module]]:
    """The Python programs held in the string constants of ``tree`` (a subprocess's script),
    with the line each starts on: those that parse and import something."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(inner)):
                found.append((node.lineno, inner))
    return found


def private_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) of each write to a module's underscore-named attribute in ``source``, the
    scripts its strings hold included."""
    tree = ast.parse(source)
    found = []
    for start, module in [(1, tree), *_scripts(tree)]:
        writes = _Writes(module)
        writes.visit(module)
        found += [(start + line - 1, what) for line, what in writes.found]
    return sorted(found)


def test_the_checker_sees_each_form_of_write():
    planted = "\n".join([
        "import cuflash.torch.calls",
        "from cuflash import _compile, api",
        "class Local:",
        "    _seen = 0",
        "Local._seen = 1",  # (a class of this file: its own business)
        "def test(monkeypatch, thing):",
        "    monkeypatch.setattr(_compile, '_run', None)",
        "    setattr(api, '_warm', {})",
        "    monkeypatch.setattr('cuflash.api._warm', {})",
        "    _compile._run = None",
        "    cuflash.torch.calls._forward, api.x = None, 1",
        "    api._count += 1",
        "    monkeypatch.setattr(_compile, 'run', None)",  # (a public seam)
        "    monkeypatch.setattr(api.Thing, '__init__', None)",  # (a special name)
        "    thing._state = 1",  # (an object the test made)
        "    self._x = 1",
        "SCRIPT = \"\"\"",
        "from cuflash import _compile",
        "_compile._run = None",
        "\"\"\"",
    ])
    assert [line for line, _ in private_writes(planted)] == [7, 8, 9, 10, 11, 12, 19]


def test_no_test_or_script_writes_a_module_s_private_attribute():
    found = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, what in private_writes(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, "writes to private names (make the seam a public, documented name):\n" + "\n".join(found)
