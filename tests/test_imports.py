"""The package's one-way import rule (docs/architecture.md, "Import rule"), checked on the source text.

Every `import weave_moe.X` / `from weave_moe.X import ...` anywhere in a module (function bodies included) must point
to a part on the same level or a lower one. Fast: it parses files, it imports nothing.
"""

from __future__ import annotations

import ast
import pathlib

import weave_moe

PACKAGE = pathlib.Path(weave_moe.__file__).resolve().parent

#: Lowest first. A module may import its own level and the levels below it, never above. The layer reaches the
#: backends by name (importlib) only when a layer is built, so `import weave_moe.layer` stays light.
LEVELS = [
    {"models"},
    {"routing", "reference", "checkpoint"},
    {"plan"},
    {"sim"},
    {"backends"},
    {"layer"},
    {"testing", "bench", "validate", "hf"},
    {"commands", "cli"},
]
LEVEL = {part: index for index, parts in enumerate(LEVELS) for part in parts}


def _part(module: str) -> str | None:
    """'weave_moe.backends.weave.layout' -> 'backends'; None for the package itself."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else None


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported weave_moe module) for every import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("weave_moe.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "weave_moe":  # from weave_moe import plan / MoESpec: the module that defines the name
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    if sub.is_dir() or sub.with_suffix(".py").is_file():
                        found.append((node.lineno, f"weave_moe.{alias.name}"))
                    elif alias.name in weave_moe._PUBLIC:
                        found.append((node.lineno, weave_moe._PUBLIC[alias.name]))
            elif node.module.startswith("weave_moe."):
                found.append((node.lineno, node.module))
    return found


def test_every_part_of_the_package_has_a_level():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts <= set(LEVEL), f"add {sorted(parts - set(LEVEL))} to LEVELS here and to docs/architecture.md"


def test_imports_point_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if relative.name == "__main__":  # an entry point (`python -m ...`) may start the command line
            continue
        source = _part(".".join(relative.parts).removesuffix(".__init__"))
        if source is None:
            continue
        for line, target in _imports(path):
            target_part = _part(target)
            if target_part is not None and LEVEL[target_part] > LEVEL[source]:
                wrong.append(f"{relative}.py:{line} imports {target} ({source} may not import {target_part})")
    assert not wrong, "\n".join(wrong)
