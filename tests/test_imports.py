"""The package's inner modules (those named with a leading underscore; the planner's package
as one) import no circle, type hints and imports inside functions included: data flows one
way, arrays -> checks -> plan -> compiled kernels -> launch."""
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


def test_the_inner_modules_import_no_circle():
    imports = inner_imports()
    assert {"_options", "_plan", "_kernels", "_compile", "_device", "_driver"} <= set(imports)

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in imports.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    assert not [m for m in imports if m in reaches(m)], {m: sorted(i) for m, i in imports.items()}
