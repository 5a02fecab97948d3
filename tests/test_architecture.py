"""The import graph of src/longrl, read from the source with ``ast`` (nothing is imported), against the layer order.

Every ``import`` and ``from ... import`` of a longrl module counts, at module level or inside a function alike (a
function-level import hides a dependency from import time, not from the design). ``from PKG import name`` is an edge
to ``PKG.name`` when that is a module, else to ``PKG`` (its ``__init__``). Dynamic imports (``importlib``, the lazy
name table of ``longrl/__init__.py``) are not read.

Layers, top to bottom. A module may import its own folder, another folder of its own layer, and any lower layer:

  10  longrl (the package face), longrl.__main__
   9  cli, compat        the command line; TRL's and Unsloth's Python APIs over the recipes
   8  recipes            GRPOTrainer, SFTTrainer: one training loop each
   7  training, export   what the recipes share (model set-up, checkpoints, guards, reporting, evaluation);
                         export sits beside it: it reads a run's checkpoints (training/checkpoint.py), and the
                         recipes' save_model and the CLI call it
   6  agents, tasks, data  agents/rollout.py drives the sampler through multi-turn episodes, one layer above it;
                         tasks/tools.py is an agents Environment, so the built-in tasks sit with agents; data turns
                         files, hub datasets and tasks into prompt rows (above tasks), and training's evaluation
                         reads prompts (below training)
   5  rollout            the sampler: prefill, decode, sampling kernels, the KV cache
   4  memory             the planner and its layout, offloading, tiling, micro-batching
   3  models             loading, quantization, LoRA, the policy's log-probs
   2  ops                kernels and the loss math, on tensors alone
   1  rewards, allocator  no longrl imports: reward functions and their isolation; the CUDA allocator's settings
   0  config             the settings tree: imports nothing of longrl but itself, so any layer may read it

The checks: (a) no import cycle between modules; (b) nothing below recipes/cli/compat imports them; (c) only cli/
(and compat/ itself, and the package face) imports compat/; (d) no import up the layers unless listed in
ALLOWED_UPWARD (at most 3 entries), each of whose imports carries a ``# upward: why`` comment on the import
statement's lines or the line just above it. A new top-level folder must be given a layer here. Importing the package face itself (``from .. import __version__``)
is not an upward import: Python runs ``longrl/__init__.py`` before any longrl module anyway, and at import time it
imports allocator.py alone (its public names load lazily); a cycle through it is still a cycle.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS = {
    "(face)": 10, "__main__": 10,
    "cli": 9, "compat": 9,
    "recipes": 8,
    "training": 7, "export": 7,
    "agents": 6, "tasks": 6, "data": 6,
    "rollout": 5,
    "memory": 4,
    "models": 3,
    "ops": 2,
    "rewards": 1, "allocator": 1,
    "config": 0,
}
TOP = ("recipes", "cli", "compat")  # nothing below these imports them, allowances or not
COMPAT_USERS = ("cli", "compat", "(face)")
# (importing module, imported module) → why; each such import statement carries `# upward: why` in the source
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
MAX_ALLOWED = 3


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module name, e.g. longrl.models.policy
    target: str  # the module it imports
    path: Path  # the importing file
    file: str  # the same, as src/longrl/...
    line: int  # first and last line of the import statement
    end_line: int
    in_function: bool

    def __str__(self) -> str:
        inside = " (inside a function)" if self.in_function else ""
        return f"{self.importer} -> {self.target}  [{self.file}:{self.line}{inside}]"


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name → file, for every .py under src/longrl (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((src / "longrl").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path], src: Path) -> list[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    in_function = {id(inner) for f in functions for inner in ast.walk(f) if inner is not f}
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in modules else base_name
                       for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if (target == "longrl" or target.startswith("longrl.")) and target != module:
                edges.append(Edge(module, target, path, f"src/{path.relative_to(src).as_posix()}", node.lineno,
                                  node.end_lineno or node.lineno, id(node) in in_function))
    return sorted(edges, key=lambda e: (e.line, e.target))


@functools.lru_cache(maxsize=None)
def import_graph(src: Path = SRC) -> tuple[Edge, ...]:
    """Every import of a longrl module by a longrl module, file by file, in line order."""
    modules = module_files(src)
    return tuple(e for name, path in modules.items() for e in _imports(name, path, modules, src))


def folder(module: str) -> str:
    """The layer key of a module: its top-level folder under longrl/, a root module's own name, or (face)."""
    parts = module.split(".")
    return "(face)" if len(parts) == 1 else parts[1]


# ----------------------------------------------------------------------------- the checks (each returns its findings)

def unplaced_folders(modules: dict[str, Path]) -> list[str]:
    return sorted({folder(m) for m in modules} - set(LAYERS))


def cycles(edges) -> list[str]:
    """Each strongly connected group of modules (Tarjan's algorithm), with a shortest cycle through each of its
    members (duplicates dropped), written out edge by edge."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.importer, {}).setdefault(e.target, e)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        found: list[list[Edge]] = []
        for start in sorted(group):
            cycle = _shortest_cycle(start, group, graph)
            if {id(e) for e in cycle} not in [{id(e) for e in c} for c in found]:
                found.append(cycle)
        out.append(f"cycle among {', '.join(sorted(group))}:\n" + "\n".join(
            "    " + "\n    ".join(map(str, c)) for c in found))
    return sorted(out)


def _shortest_cycle(start: str, group: set, graph: dict[str, dict[str, Edge]]) -> list[Edge]:
    """The edges of a shortest path from ``start`` back to itself inside ``group`` (breadth-first)."""
    paths, frontier = {start: []}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, e in sorted(graph.get(v, {}).items()):
                if w == start:
                    return paths[v] + [e]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [e]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its group")


def imports_into_top(edges) -> list[str]:
    """(b): a lower folder importing recipes/, cli/ or compat/."""
    return [str(e) for e in edges if folder(e.target) in TOP and LAYERS.get(folder(e.importer), 0) <
            LAYERS.get(folder(e.target), 0)]


def compat_imports(edges) -> list[str]:
    """(c): compat/ imported by anything but cli/, compat/ itself and the package face."""
    return [str(e) for e in edges if folder(e.target) == "compat" and folder(e.importer) not in COMPAT_USERS]


def config_imports_outside(edges) -> list[str]:
    """config/ importing any other part of longrl (it is read by every layer and reads none)."""
    return [str(e) for e in edges if folder(e.importer) == "config" and folder(e.target) != "config"]


def _up(e: Edge) -> bool:
    """Whether ``e`` points up the layers (the package face itself, ``longrl``, is no one's layer: see the top)."""
    return e.target != "longrl" and LAYERS.get(folder(e.importer), 0) < LAYERS.get(folder(e.target), 0)


def upward_imports(edges, allowed: dict = ALLOWED_UPWARD) -> list[str]:
    """(d): an import up the layers that the allow-list does not name."""
    return [str(e) for e in edges if (e.importer, e.target) not in allowed and _up(e)]


def unexplained_allowances(edges, allowed: dict = ALLOWED_UPWARD) -> list[str]:
    """Allow-list entries past MAX_ALLOWED, naming no import up the layers, or an import without ``# upward:``."""
    out = [f"ALLOWED_UPWARD has {len(allowed)} entries; at most {MAX_ALLOWED}"] if len(allowed) > MAX_ALLOWED else []
    for importer, target in allowed:
        found = [e for e in edges if (e.importer, e.target) == (importer, target)]
        if not found:
            out.append(f"ALLOWED_UPWARD names {importer} -> {target}, which no longer imports it: drop the entry")
        elif not any(_up(e) for e in found):
            out.append(f"ALLOWED_UPWARD names {importer} -> {target}, which is not an upward import: drop the entry")
        for e in found:
            lines = e.path.read_text().splitlines()
            if not any("# upward:" in lines[n - 1] for n in range(max(e.line - 1, 1), e.end_line + 1)):
                out.append(f"{e}: allowed upward import without a '# upward: why' comment")
    return out


# ----------------------------------------------------------------------------- the package's own graph

def _report(title: str, found: list[str]) -> str:
    return f"{title} ({len(found)}):\n  " + "\n  ".join(found)


def test_every_folder_has_a_layer():
    missing = unplaced_folders(module_files())
    assert not missing, f"folders without a layer in tests/test_architecture.py LAYERS: {', '.join(missing)}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, _report("import cycles (module or function level)", found)


def test_nothing_below_imports_recipes_cli_or_compat():
    found = imports_into_top(import_graph())
    assert not found, _report("imports up into recipes/, cli/ or compat/", found)


def test_only_cli_and_the_package_face_import_compat():
    found = compat_imports(import_graph())
    assert not found, _report("imports of compat/ from outside cli/ and the package face", found)


def test_config_imports_nothing_of_longrl_outside_config():
    found = config_imports_outside(import_graph())
    assert not found, _report("config/ importing other longrl folders", found)


def test_imports_point_down_the_layers():
    found = upward_imports(import_graph())
    assert not found, _report("imports up the layers (not in ALLOWED_UPWARD)", found)


def test_the_allow_list_is_short_and_explained():
    found = unexplained_allowances(import_graph())
    assert not found, _report("ALLOWED_UPWARD problems", found)


# ----------------------------------------------------------------------------- the checks catch what they should

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "src" / "longrl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "src"


def test_the_checks_find_each_kind_of_violation(tmp_path):
    src = _package(tmp_path, {
        "__init__.py": "",
        "ops/losses.py": "def f():\n    from ..models import policy\n",  # up, inside a function
        "ops/rotary.py": "from .. import __version__\n",  # the package face: no one's layer
        "models/__init__.py": "from . import policy\n",
        "models/policy.py": "from ..ops import losses\nfrom .. import models\n",  # a cycle with models/__init__
        "memory/planner.py": "from longrl.training import setup  # upward: the test's own reason\n",
        "training/__init__.py": "",
        "training/setup.py": "from ..recipes.grpo import Trainer\nfrom ..compat.trl import GRPOConfig\n",
        "recipes/grpo.py": "from ..models.policy import logps\n",
        "compat/trl.py": "from ..recipes.grpo import Trainer\n",
        "cli/main.py": "from ..compat import trl\nfrom ..recipes import grpo\n",
        "config/schema.py": "import longrl.ops.losses\n",
        "newfolder/x.py": "",
    })
    edges = import_graph(src)
    assert unplaced_folders(module_files(src)) == ["newfolder"]
    found = cycles(edges)  # one group of three modules: models <-> models.policy, and models.policy <-> ops.losses
    assert len(found) == 1 and found[0].startswith(
        "cycle among longrl.models, longrl.models.policy, longrl.ops.losses:"), found
    for edge in ("longrl.models -> longrl.models.policy  [src/longrl/models/__init__.py:1]",
                 "longrl.models.policy -> longrl.models  [src/longrl/models/policy.py:2]",
                 "longrl.ops.losses -> longrl.models.policy  [src/longrl/ops/losses.py:2 (inside a function)]",
                 "longrl.models.policy -> longrl.ops.losses  [src/longrl/models/policy.py:1]"):
        assert edge in found[0], found[0]
    assert cycles([e for e in edges if e.importer != "longrl.ops.losses" and e.target != "longrl.models"]) == []
    assert [s.split("  [")[0] for s in imports_into_top(edges)] == [
        "longrl.training.setup -> longrl.recipes.grpo", "longrl.training.setup -> longrl.compat.trl"]
    assert [s.split("  [")[0] for s in compat_imports(edges)] == ["longrl.training.setup -> longrl.compat.trl"]
    assert [s.split("  [")[0] for s in config_imports_outside(edges)] == ["longrl.config.schema -> longrl.ops.losses"]
    up = [s.split("  [")[0] for s in upward_imports(edges, {})]
    assert sorted(up) == sorted(["longrl.ops.losses -> longrl.models.policy", "longrl.config.schema -> longrl.ops.losses",
                                 "longrl.memory.planner -> longrl.training.setup",
                                 "longrl.training.setup -> longrl.recipes.grpo",
                                 "longrl.training.setup -> longrl.compat.trl"])
    # an allowance silences its import only; it needs the comment, a real upward import, and a short list
    allowed = {("longrl.memory.planner", "longrl.training.setup"): "why"}
    assert not any("memory.planner" in s for s in upward_imports(edges, allowed))
    assert unexplained_allowances(edges, allowed) == []
    no_comment = {("longrl.ops.losses", "longrl.models.policy"): "why"}
    assert "without a '# upward: why' comment" in unexplained_allowances(edges, no_comment)[0]
    assert "not an upward import" in unexplained_allowances(edges, {("longrl.cli.main", "longrl.compat.trl"): ""})[0]
    assert "no longer imports it" in unexplained_allowances(edges, {("longrl.ops.losses", "longrl.cli.main"): ""})[0]
    many = {**allowed, **no_comment, ("a", "b"): "", ("c", "d"): ""}
    assert unexplained_allowances(edges, many)[0] == "ALLOWED_UPWARD has 4 entries; at most 3"


def test_public_names_resolve_after_the_moves():
    """Everything ``longrl`` exports loads, and names that moved down a floor stay reachable where they were public."""
    import longrl
    from longrl import memory, models
    from longrl.memory import tiling
    from longrl.models.structure import decoder_layers
    from longrl.models.tiled_mlp import TiledMLP
    from longrl.ops.unwrap import base_model
    from longrl.training import distributed

    for name in longrl.__all__:
        assert getattr(longrl, name) is not None, name
    assert longrl.GRPOTrainer.__module__ == "longrl.compat.trl" and longrl.GRPOConfig.__module__.startswith("longrl.compat")
    assert memory.TiledMLP is tiling.TiledMLP is TiledMLP
    assert models.base_model is base_model
    assert distributed.decoder_layers is decoder_layers
    for package in (memory, models):
        for name in package.__all__:
            assert hasattr(package, name), name
