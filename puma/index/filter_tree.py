"""The parsed filter: a tree of conditions joined by and/or/not, with one canonical JSON form.

``puma.index.filters`` reads a filter into this tree (``parse_filter``) and checks it against column
types; ``puma.index.filter_eval`` evaluates it on Arrow columns. ``value_kind`` (the filter type a
value compares with) and ``shown`` (a value as short text for error messages) serve every stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar


class Filter:
    """A parsed filter: immutable, hashable, equal to another with the same canonical ``key``."""

    def to_json(self) -> dict:
        """The canonical JSON form (and/or parts flattened, sorted, deduplicated)."""
        raise NotImplementedError

    def conditions(self) -> Iterator[Condition]:
        """Every column condition in the tree."""
        raise NotImplementedError

    def columns(self) -> frozenset[str]:
        """The columns the filter names."""
        return frozenset(c.column for c in self.conditions())

    @cached_property
    def key(self) -> str:
        """Canonical JSON text, the same for equivalent spellings: a cache key for selections."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filter) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


@dataclass(frozen=True, eq=False)
class Condition(Filter):
    """``column op value``; value is str, int, float or bool, a sorted tuple of them for ``in``."""

    column: str
    op: str
    value: Any
    path: str = field(default="", repr=False)  # where the request wrote it, for error messages

    def to_json(self) -> dict:
        value = list(self.value) if self.op == "in" else self.value
        return {self.column: {self.op: value}}

    def conditions(self) -> Iterator[Condition]:
        yield self


@dataclass(frozen=True, eq=False)
class Joined(Filter):
    """Parts joined by ``OP`` (And, Or)."""

    parts: tuple[Filter, ...]
    OP: ClassVar[str] = ""

    def to_json(self) -> dict:
        return _joined_json(self.OP, self.parts)

    def conditions(self) -> Iterator[Condition]:
        for part in self.parts:
            yield from part.conditions()


class And(Joined):
    """Every part matches."""

    OP = "and"


class Or(Joined):
    """At least one part matches."""

    OP = "or"


@dataclass(frozen=True, eq=False)
class Not(Filter):
    """The part does not match (a missing value counts as not matching, so ``not`` matches it)."""

    part: Filter

    def to_json(self) -> dict:
        inner = self.part.to_json()
        return inner["not"] if list(inner) == ["not"] else {"not": inner}

    def conditions(self) -> Iterator[Condition]:
        yield from self.part.conditions()


def _joined_json(op: str, parts: tuple[Filter, ...]) -> dict:
    """``{op: [...]}`` with nested ``op`` lists flattened, sorted and deduplicated; one part alone."""
    items = []
    for part in parts:
        inner = part.to_json()
        items.extend(inner[op] if list(inner) == [op] else [inner])
    unique = {json.dumps(item, sort_keys=True, ensure_ascii=False): item for item in items}
    ordered = [unique[text] for text in sorted(unique)]
    return ordered[0] if len(ordered) == 1 else {op: ordered}



def value_kind(value: Any) -> str:
    """The filter type a value (or the first of an 'in' tuple) compares with."""
    if isinstance(value, tuple):
        value = value[0]
    if isinstance(value, bool):
        return "boolean"
    return "string" if isinstance(value, str) else "number"


def shown(value: Any) -> str:
    """A value as JSON text of at most 80 characters, for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
