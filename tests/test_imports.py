"""The package's inner modules (those named with a leading underscore; the planner's package
as one) import no circle, type hints and imports inside functions included: data flows one
way, arrays -> checks -> plan -> compiled kernels -> launch. No module of the package at all
imports a circle either: a front end's package exports what its modules (the calls, the ring
built on them) define, and they never import it back."""
import ast
from pathlib import Path

import cuflash

PACKAGE = Path(cuflash.__file__).parent


def inner_imports() -> dict[str, set[str]]:
    """Each inner module -> the inner modules it imports (the planner's modules as "_plan")."""
    imports: dict[str, set[str]] = {}
    for path in [*PACKAGE.glob("_*.py"), *(PACKAGE / "_plan").glob("*.py")]:
        module = "_plan" if path.parent.name == "_plan" else path.stem
        if module == "__init__":
            continue
        found = imports.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                inside_plan = module == "_plan" and node.level == 1
                if inside_plan:
                    continue
                if node.module is None:  # from . import a, b
                    found |= {a.name for a in node.names}
                else:
                    found.add(node.module.split(".")[0])
    return {module: {m for m in found if m.startswith("_") and m != module} for module, found in imports.items()}


def in_circles(imports: dict[str, set[str]]) -> set[str]:
    """The modules that reach themselves through what they import."""

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in imports.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    return {m for m in imports if m in reaches(m)}


def test_the_inner_modules_import_no_circle():
    imports = inner_imports()
    assert {"_options", "_plan", "_kernels", "_compile", "_device", "_driver"} <= set(imports)
    assert not in_circles(imports), {m: sorted(i) for m, i in imports.items()}


def package_imports() -> dict[str, set[str]]:
    """Each module of the package, by its dotted name -> the package's modules it imports.
    Importing a module imports its packages first, which is no edge of the code:
    ``from . import calls`` imports the module calls, not the package that holds it."""
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("cuflash", *path.relative_to(PACKAGE).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(filter(None, (package.rsplit(".", node.level - 1)[0], node.module)))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
        imports[module] = {m for m in found if m in paths and m != module}
    return imports


def test_no_module_of_the_package_imports_a_circle():
    imports = package_imports()
    assert {"cuflash.torch.calls", "cuflash.torch.ring", "cuflash.jax.calls", "cuflash.jax.ring"} <= set(imports)
    assert "cuflash.torch.calls" in imports["cuflash.torch.ring"] and "cuflash.jax.calls" in imports["cuflash.jax.ring"]
    circled = in_circles(imports)
    assert not circled, {m: sorted(imports[m] & circled) for m in sorted(circled)}
