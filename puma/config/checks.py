"""The checks every config section runs in ``__post_init__``, and the error they raise.

``ConfigError`` is a ``UserError`` (the jobs print it without a traceback) and a ``ValueError``.
The helpers name the dotted key, the value that arrived and what is valid.
"""

from __future__ import annotations

from puma.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration key or value is invalid; the message says which and what is valid."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    _check(lo <= value <= hi, f"{name}={value!r} is out of range; valid: {lo} <= {name} <= {hi}")


def _check_custom_resources(name: str, value: dict) -> None:
    """{resource name: amount > 0}; CPU, GPU and memory have keys of their own."""
    _check(isinstance(value, dict), f"{name} must be a mapping of custom resource -> amount, got {value!r}")
    for key, amount in value.items():
        _check(str(key) not in ("CPU", "GPU", "memory", "object_store_memory"),
               f"{name}: {key!r} is set by its own key (cpus/gpus per worker or actor); list custom "
               "resources only")
        ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount > 0
        _check(ok, f"{name}: {key}={amount!r} must be a number > 0")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}={value!r} is not valid; choose one of {list(choices)}")
