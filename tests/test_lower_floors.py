"""The lower floors of the package import only downward (memory → models → ops), with no circles among their
modules, and the names that moved between them stay reachable where they were public."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import longrl

ROOT = Path(longrl.__file__).parent
# what each floor may import of longrl besides itself; memory's planner also reads the allocator's settings and
# the config tree, which sit beside the floors (config imports nothing of longrl but itself)
ALLOWED = {"ops": set(), "models": {"ops"}, "memory": {"models", "ops", "config", "allocator"}}


def relative_imports(path: Path) -> set[str]:
    """The longrl modules ``path`` imports by relative import, anywhere in it (function-level ones too), as dotted
    names under ``longrl`` ("ops.rotary", "models")."""
    package = list(path.relative_to(ROOT).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            found.add(".".join(base + ([node.module] if node.module else [])))
    return found


def floor_modules(floor: str) -> dict[str, set[str]]:
    """Module (dotted, without the package's ``__init__``) → the longrl modules it imports, for one folder."""
    out = {}
    for path in sorted((ROOT / floor).glob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = relative_imports(path)
    return out


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_floor_imports_only_downward(floor):
    upward = {(module, target) for module, targets in floor_modules(floor).items() for target in targets
              if target.split(".")[0] not in ALLOWED[floor] | {floor}}
    assert not upward, f"{floor}/ imports upward: {sorted(upward)}"


def test_no_import_circles_among_the_lower_floors():
    graph = {}
    for floor in ALLOWED:
        graph.update(floor_modules(floor))

    def modules_run(importer: str, target: str) -> list[str]:  # from another folder, the package's __init__ first
        package = target.split(".")[0]
        return [target] + ([package] if package not in (target, importer.split(".")[0]) else [])

    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph.get(module, ()):
            for t in modules_run(module, target):
                if t not in graph or t == module:
                    continue
                assert state.get(t) != "open", f"import circle: {' → '.join(path + [t])}"
                if t not in state:
                    visit(t, path + [t])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_moved_names_stay_reachable_where_they_were_public():
    from longrl import memory, models
    from longrl.memory import tiling
    from longrl.models.structure import decoder_layers
    from longrl.models.tiled_mlp import TiledMLP
    from longrl.ops.unwrap import base_model
    from longrl.training import distributed

    assert memory.TiledMLP is tiling.TiledMLP is TiledMLP
    assert models.base_model is base_model
    assert distributed.decoder_layers is decoder_layers
    for name in memory.__all__:
        assert hasattr(memory, name), name
    for name in models.__all__:
        assert hasattr(models, name), name
