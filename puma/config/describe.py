"""Every key described: type, default and the comment written beside its field in the source
(``--help-config`` and docs/reference/config.md, so neither can drift from the code)."""

from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import tokenize
import types
import typing
from typing import Any

from puma.config.loader import Config, _field_types, _is_dataclass_type, _join


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's description, from the source: the comment ending its line, continued by comment
    lines right below it (so ``--help-config`` cannot drift from the code)."""
    source = inspect.getsource(cls)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            parts = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            below = node.end_lineno + 1
            while below <= len(lines) and lines[below - 1].strip().startswith("#"):
                parts.append(comments[below])
                below += 1
            docs[node.target.id] = " ".join(parts)
    return docs


def describe_keys(cls: type = Config, prefix: str = "",
                  defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every leaf key, in declaration order."""
    defaults = cls() if defaults is None else defaults
    out = []
    docs = field_docs(cls)
    for name, tp in _field_types(cls).items():
        key, value = _join(prefix, name), getattr(defaults, name)
        if _is_dataclass_type(tp):
            out += describe_keys(tp, key, value)
        else:
            out.append((key, _type_name(tp), _show(value), docs.get(name, "")))
    return out


def help_config_lines() -> list[str]:
    """``--help-config``: one line per key with its type, default and description."""
    return [f"{key} ({tp}, default {default}): {doc}" for key, tp, default, doc in describe_keys()]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp)).replace("NoneType", "null")
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)
