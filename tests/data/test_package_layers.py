"""data/'s sub-packages import each other without a circle, in the order tokenizer -> streams -> pretrain -> records ->
sft -> preference (demo on top): a reader can take each in that order, and none needs one above it."""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("tokenizer", "streams", "pretrain", "records", "sft", "preference", "demo")  # lowest first


def subpackage_imports(root: Path) -> dict[tuple[str, str], str]:
    """{(importer, imported): one importing module} between the sub-packages of ``root``/data."""
    sys.path.insert(0, str(root))
    try:
        graph = grimp.build_graph("data", cache_dir=None)
    finally:
        sys.path.remove(str(root))
    edges: dict[tuple[str, str], str] = {}
    for module in sorted(graph.modules):
        parts = module.split(".")
        if len(parts) < 3:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            target = imported.split(".")
            if len(target) >= 2 and target[0] == "data" and target[1] != parts[1]:
                edges.setdefault((parts[1], target[1]), f"{module} imports {imported}")
    return edges


def circles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """Each circle of the sub-package graph, once, as the packages along it."""
    following: dict[str, set[str]] = {}
    for importer, imported in edges:
        following.setdefault(importer, set()).add(imported)
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(following.get(path[-1], ())):
            if nxt == path[0]:
                found.append(path)
            elif nxt not in path and nxt > path[0]:  # each circle from its smallest package only
                walk([*path, nxt])

    for start in sorted(following):
        walk([start])
    return found


def test_no_circle_between_data_subpackages() -> None:
    edges = subpackage_imports(ROOT)
    found = circles(edges)
    described = [
        " -> ".join([*circle, circle[0]])
        + ": "
        + "; ".join(edges[(a, b)] for a, b in zip(circle, [*circle[1:], circle[0]]))
        for circle in found
    ]
    assert not found, "data sub-packages import each other in a circle:\n" + "\n".join(described)


def test_data_subpackages_import_only_those_below() -> None:
    subpackages = {path.parent.name for path in (ROOT / "data").glob("*/__init__.py")}
    assert subpackages == set(ORDER), f"data's sub-packages {sorted(subpackages)}: place each in ORDER"
    upward = [why for (a, b), why in subpackage_imports(ROOT).items() if ORDER.index(b) > ORDER.index(a)]
    assert not upward, "a data sub-package imports one above it:\n" + "\n".join(sorted(upward))
