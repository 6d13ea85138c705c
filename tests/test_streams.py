"""One table of random streams: no two draws of a run share an id (lightning_pfl.streams)."""

from __future__ import annotations

import ast
from itertools import combinations
from pathlib import Path

import lightning_pfl.streams as streams

PACKAGE = Path(streams.__file__).parent


def clashes(named: dict[str, int]) -> set[frozenset[str]]:
    return {
        frozenset({a, b})
        for (a, x), (b, y) in combinations(named.items(), 2)
        if x == y and frozenset({a, b}) not in streams.KEPT_OVERLAPS
    }


def test_run_wide_streams_differ_from_each_other_and_from_every_methods() -> None:
    assert not clashes(streams.RUN_WIDE)
    for method, own in streams.PER_METHOD.items():
        assert not clashes({**streams.RUN_WIDE, **own}), method


def test_every_stream_id_is_defined_in_the_table_only() -> None:
    """No module defines its own ``*_STREAM`` constant: they all import the table's."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "streams.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                names += [
                    e.id
                    for t in node.targets
                    if isinstance(t, ast.Tuple)
                    for e in t.elts
                    if isinstance(e, ast.Name)
                ]
                assert not [n for n in names if n.endswith("_STREAM")], (path, names)
