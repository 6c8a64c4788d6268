"""A multipart form's nested fields as the OpenAI SDK writes them, folded back into the JSON
body's objects.

The SDK flattens a multipart request's ``extra_body`` with brackets (its ``_qs`` module,
``array_format="brackets"``): ``{"step_cache": {"policy": "every", "every": 3}}`` arrives as
the text fields ``step_cache[policy]=every`` and ``step_cache[every]=3``, and
``{"loras": [{"name": "a", "scale": 0.5}, {"name": "b"}]}`` as ``loras[][name]=a``,
``loras[][scale]=0.5``, ``loras[][name]=b`` (in that order: a key seen again in the current
element starts the next one, as the SDK writes each element's keys together). Only the
extension fields in ``NESTED`` are folded, each key typed as the JSON body types it; any
other bracketed name stays as it is (and is refused as an unknown field by the parsers).

Called by the edits route and the video jobs' form reader, before their per-field parsing,
which reads each field's one value with ``once``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from starlette.datastructures import FormData

from ditserve.engine.server.errors import invalid, shown

# field -> (a list of objects?, each key's JSON type)
NESTED: dict[str, tuple[bool, dict[str, type]]] = {
    "step_cache": (False, {"policy": str, "threshold": float, "every": int}),
    "loras": (True, {"name": str, "scale": float}),
}
_KEY = re.compile(r"^([a-z_]+)(\[\])?\[([a-z_]+)\]$")


def _typed(field: str, key: str, kind: type, value: Any) -> Any:
    if not isinstance(value, str):
        raise invalid(field, f"{field}[{key}]: must be a text field, not a file")
    if kind is str:
        return value
    try:
        number = int(value) if kind is int else float(value)
    except ValueError as e:
        name = "an integer" if kind is int else "a number"
        raise invalid(field, f"{field}[{key}]: must be {name}, got {shown(value)}") from e
    if not math.isfinite(number):
        raise invalid(field, f"{field}[{key}]: is out of range, got {shown(value)}")
    return number


def fold_nested(items: Iterable[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """(the form's other items in their order, the folded fields by name); a field given
    both bracketed and plain, or a key not in the field's object, is a 400."""
    plain: list[tuple[str, Any]] = []
    folded: dict[str, Any] = {}
    for name, value in items:
        match = _KEY.match(name)
        if match is None or match.group(1) not in NESTED:
            plain.append((name, value))
            continue
        field, listed, key = match.group(1), match.group(2) is not None, match.group(3)
        is_list, keys = NESTED[field]
        if listed != is_list:
            form = f"{field}[][KEY]" if is_list else f"{field}[KEY]"
            raise invalid(field, f"{name}: {field} is {'a list of objects' if is_list else 'an object'}"
                                 f"; its form fields are named {form}")
        if key not in keys:
            raise invalid(field, f"{name}: unknown key {key!r}; {field} takes "
                                 f"{', '.join(keys)}")
        typed = _typed(field, key, keys[key], value)
        if is_list:
            elements = folded.setdefault(field, [])
            if not elements or key in elements[-1]:
                elements.append({})
            elements[-1][key] = typed
        else:
            obj = folded.setdefault(field, {})
            if key in obj:
                raise invalid(field, f"{name}: is given twice; give it once")
            obj[key] = typed
    for name, _ in plain:
        if name in folded:
            raise invalid(name, f"{name}: is given both as a field and as {name}[...]; give "
                                "one")
    return plain, folded


def once(form: FormData, name: str) -> Any:
    """The one value of the form's field ``name`` (None when absent); a 400 when it is given
    more than once."""
    values = form.getlist(name)
    if len(values) > 1:
        raise invalid(name, f"{name}: is given {len(values)} times; give it once")
    return values[0] if values else None
