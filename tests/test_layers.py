"""The package's layers: data flows one way, so no module imports from a layer above its own.

runtime, vllm_engine < heads < profile < recipe/data/features/assets < train < evaluate < export < commands (and
the `mtp-train` entry point). `profile` (measurement: the eval's cost curve, the bench scripts' step timings) sits
above what it measures; of the stages only `evaluate` calls it, and only when the recipe asks (`eval.cost_curve`). The shared base (errors, fileio, fingerprint) sits below everything. Every import counts, including the
ones inside functions (the CLI keeps heavy imports lazy, so a top-level-only check would miss most of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mtp_train

PACKAGE_DIR = Path(mtp_train.__file__).parent

# Layer of each top-level part of the package (a subpackage or a module), lowest first.
LAYERS: dict[str, int] = {
    "__init__": 0, "__main__": 9, "errors": 0, "fileio": 0, "fingerprint": 0, "cpu_kinds": 0,
    "runtime": 1, "vllm_engine": 1,
    "heads": 2,
    "profile": 3,
    "recipe": 4, "recipe_reference": 4, "data": 4, "features": 4, "assets": 4, "cli_options": 4,
    "train": 5,
    "evaluate": 6,
    "export": 7,
    "commands": 8, "cli": 8,
}

# The stages that measure nothing: they log their own speed and call no profile (no peak probe, no cost curve).
UNPROFILED_STAGES = ("data", "features", "train", "export")
PROBES = ("mtp_train.profile", "mtp_train.runtime.hardware")


def _part_of(module: str) -> str:
    """`mtp_train.runtime.model` -> "runtime"; `mtp_train.recipe` -> "recipe"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every `import mtp_train...` / `from mtp_train... import` (relative ones
    resolved) anywhere in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("mtp_train")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from ..y import z
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("mtp_train"):
                if name == "mtp_train":  # `from mtp_train import x`: x is the part
                    found += [(node.lineno, f"mtp_train.{alias.name}") for alias in node.names]
                else:
                    found.append((node.lineno, name))
    return found


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_part_of_the_package_has_a_layer():
    parts = {_part_of(_module_name(path)) for path in _package_files()}
    assert parts - set(LAYERS) == set(), "give each new subpackage or top-level module a layer in LAYERS"


def test_no_import_from_a_higher_layer():
    violations = []
    for path in _package_files():
        importer = _part_of(_module_name(path))
        for line, imported in _imports(path):
            target = _part_of(imported)
            if target in LAYERS and LAYERS[target] > LAYERS[importer]:
                violations.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line} ({importer}, layer "
                                  f"{LAYERS[importer]}) imports {imported} ({target}, layer {LAYERS[target]})")
    assert violations == [], "imports against the layering:\n" + "\n".join(violations)


def test_the_stages_that_measure_nothing_import_no_probe():
    """prepare, precompute, train and export import neither the profile layer nor the machine probes of
    `runtime.hardware` (the matmul peak): they log tokens/s and counted FLOP/s only."""
    found = []
    for path in _package_files():
        if _part_of(_module_name(path)) in UNPROFILED_STAGES:
            found += [f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {name}" for line, name in _imports(path)
                      if name.startswith(PROBES)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from mtp_train.heads import DraftHead\n", ["mtp_train.heads"]),
    ("def f():\n    from mtp_train.export.load import load_any_head\n", ["mtp_train.export.load"]),
    ("import mtp_train.train.losses as losses\n", ["mtp_train.train.losses"]),
    ("from mtp_train import recipe\n", ["mtp_train.recipe"]),
    ("from ..evaluate import runner\n", ["mtp_train.evaluate"]),
])
def test_the_import_walk_sees_every_form(tmp_path, monkeypatch, source, expected):
    """The checker itself: top-level, function-level, `import x as y`, `from package import module`, relative."""
    fake = PACKAGE_DIR / "runtime" / "_layer_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)
    assert [name for _, name in _imports(fake)] == expected
