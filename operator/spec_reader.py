"""Typed reading of a CR's plain data: one ``SpecReader`` per mapping, problems collected.

Owns the small vocabulary ``spec.parse_spec`` reads a DiffusionDeployment with (strings with
choices, bounded integers, numbers, flags, int-or-string quantities, lists, string maps). It
never raises: every problem is appended to a shared list, so a user sees all of them at once.
Called by ``spec`` only; pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_DECIMAL = re.compile(r"^[0-9]+(\.[0-9]+)?$")  # the CRD schema's pattern, without "auto"


class SpecReader:
    """Typed access to one mapping of the spec; collects problems instead of raising early."""

    def __init__(self, data: Any, path: str, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            problems.append(f"{path} must be an object, got {type(data).__name__}")
            data = {}
        self.data: Mapping[str, Any] = data

    def _get(self, key: str, types: tuple[type, ...], default: Any, what: str) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        # bool is an int subclass; never accept it where a number is expected.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            self.problems.append(f"{self.path}.{key} must be {what}, got {value!r}")
            return default
        return value

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> Any:
        value = self._get(key, (str,), default, "a string")
        if choices and value is not None and value not in choices:
            self.problems.append(f"{self.path}.{key} must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def integer(self, key: str, default: int | None, minimum: int = 0) -> Any:
        value = self._get(key, (int,), default, f"an integer >= {minimum}")
        if value is not None and value < minimum:
            self.problems.append(f"{self.path}.{key} must be an integer >= {minimum}, got {value}")
            return default
        return value

    def number(self, key: str, default: float | None) -> Any:
        value = self._get(key, (int, float), default, "a number >= 0")
        if value is not None and value < 0:
            self.problems.append(f"{self.path}.{key} must be a number >= 0, got {value}")
            return default
        return None if value is None else float(value)

    def flag(self, key: str, default: bool) -> bool:
        return bool(self._get(key, (bool,), default, "true or false"))

    def optional_flag(self, key: str) -> bool | None:
        """A flag whose absence means "decide for me" (None)."""
        value = self._get(key, (bool,), None, "true or false")
        return None if value is None else bool(value)

    def int_or_str(self, key: str, default: int | str) -> Any:
        value = self._get(key, (int, str), default, "an integer or a string")
        return str(value) if isinstance(value, int) and isinstance(default, str) else value

    def number_or_word(self, key: str, word: str) -> float | str | None:
        """An int-or-string field holding a number >= 0 (an integer, or any number as a
        string: "7.5") or exactly ``word``; None if unset. A YAML float is refused, as the
        CRD schema refuses it."""
        what = f"an integer >= 0, a number as a string (\"7.5\") or {word!r}"
        value = self._get(key, (int, str), None, what)
        if value is None or value == word:
            return value
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if number < 0 or number != number or isinstance(value, str) and not _DECIMAL.match(value):
            self.problems.append(f"{self.path}.{key} must be {what}, got {value!r}")
            return None
        return number

    def items(self, key: str) -> tuple[Any, ...]:
        return tuple(self._get(key, (list, tuple), (), "a list") or ())

    def string_map(self, key: str) -> dict[str, str]:
        """A map of strings to strings (labels, annotations, a node selector)."""
        value = self._get(key, (Mapping,), {}, "a map of strings") or {}
        bad = sorted(str(k) for k, v in value.items()
                     if not isinstance(k, str) or not isinstance(v, str))
        if bad:
            self.problems.append(f"{self.path}.{key} values must be strings (quote them): "
                                 f"{', '.join(bad)}")
        return {str(k): str(v) for k, v in value.items()}

    def names(self, key: str) -> tuple[str, ...]:
        """A list of ``{name: ...}`` references (imagePullSecrets)."""
        out = []
        for i, item in enumerate(self.items(key)):
            name = item.get("name") if isinstance(item, Mapping) else None
            if not isinstance(name, str) or not name:
                self.problems.append(f"{self.path}.{key}[{i}] must be an object with a name")
                continue
            out.append(name)
        return tuple(out)

    def child(self, key: str) -> SpecReader:
        return SpecReader(self.data.get(key), f"{self.path}.{key}", self.problems)
