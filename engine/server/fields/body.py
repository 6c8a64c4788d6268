"""What every request body shares, whichever route reads it: JSON decoding (400 for
malformed JSON, NaN, numbers of thousands of digits, deep nesting and bad UTF-8), the strict
number types, a pydantic validation's first problem as a field-precise 400, the check for
lone surrogates in text fields, and an engine validation error as the API's 400.

Called by the generation body's parser (``generation.request``), the video jobs' parser
(``videos.request``), the LoRA load routes (``adapters.routes``) and ``phase``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, get_args

from pydantic import BaseModel, BeforeValidator, Strict, StrictInt
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.server.errors import APIError, invalid, shown

Number = Annotated[float, Strict()]  # strict: 3 and 3.5 are numbers, "3" and true are not


def _integral(value: Any) -> Any:
    # JSON (and JSON Schema's "integer") does not tell 4 from 4.0; 4.5 and "4" stay errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]


def typed_fields(model: type[BaseModel], kind: Any) -> tuple[str, ...]:
    """The fields of ``model`` declared ``kind`` (``Integer`` or ``Number``, optional or
    not): what a form reader types its text as, read off the body's own declaration so a
    field added to the body is typed in its form too."""
    return tuple(name for name, field in model.model_fields.items()
                 if field.annotation == kind or kind in get_args(field.annotation))


_TYPE_MESSAGES = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
}


def pydantic_error(error: PydanticValidationError, *,
                   fields: tuple[str, ...]) -> APIError:
    """The first problem of a pydantic validation, as a field-precise 400 (``fields``: the
    body's field names, listed for an unknown one)."""
    first = error.errors(include_url=False)[0]
    kind, value = first.get("type", ""), first.get("input")
    # an unknown key is the client's own spelling, whatever it is: kept as the path's end
    param = field_path(first.get("loc", ()), keep_last=kind == "extra_forbidden")
    if kind == "extra_forbidden":
        top_level = param is not None and param.isidentifier()  # not loras[0].x
        listed = f"; supported fields: {', '.join(fields)}" if top_level else ""
        return invalid(param, f"{param}: unknown field{listed}", code="unknown_field")
    if kind == "missing":
        return invalid(param, f"{param}: is required", code="missing_field")
    if param == "response_format":
        return invalid(param, "response_format: only 'b64_json' is supported (this server "
                              f"does not host image URLs), got {shown(value)}")
    if kind == "literal_error":  # one of OpenAI's enumerated values (output_format, quality)
        expected = first.get("ctx", {}).get("expected", "")
        return invalid(param, f"{param}: must be one of {expected}, got {shown(value)}")
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return invalid(param, f"{param}: is out of range, got {shown(value)}")
    message = _TYPE_MESSAGES.get(kind) or first.get("msg", "is invalid")
    return invalid(param, f"{param}: {message}, got {shown(value)}")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def field_path(loc: tuple[int | str, ...] | list[int | str], *,
               keep_last: bool = False) -> str | None:
    """A pydantic error location as the body names it: ``loras[0].name``. The first part is
    the body's field as sent; after it, a union's member tags (``str``, a model's class name,
    ``function-after[...]``) are pydantic's, not the body's: dropped (``keep_last``: the last
    part is the client's key, kept as sent)."""
    out = ""
    for n, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif n == 0 or (keep_last and n == len(loc) - 1) or (
                part.isidentifier() and part.islower() and part not in _TYPE_TAGS):
            out += f".{part}" if out else str(part)
    return out or None


class _NotJSON(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NotJSON(f"the request body is not valid JSON: {name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise invalid(None, "the request body is empty; send a JSON object", code="invalid_body")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}",
                      code="invalid_json") from e
    except UnicodeDecodeError as e:
        raise invalid(None, "the request body is not valid UTF-8 text",
                      code="invalid_json") from e
    except RecursionError as e:
        raise invalid(None, "the request body nests too deeply", code="invalid_json") from e
    except _NotJSON as e:  # NaN, Infinity: Python's json reads them, JSON has no such numbers
        raise invalid(None, str(e), code="invalid_json") from e
    except ValueError as e:  # an integer of thousands of digits (Python's conversion limit)
        raise invalid(None, "the request body holds a number with too many digits",
                      code="invalid_json") from e


def check_text_fields(body: BaseModel) -> None:
    """A 400 naming the first text field that holds a lone UTF-16 surrogate: JSON's \\ud800
    escapes parse into strings that cannot be encoded, and would fail later, as a 500, in the
    tokenizer or a log line."""
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise invalid(name, f"{name}: holds a lone UTF-16 surrogate at character "
                                    f"{e.start}; send valid Unicode text") from e


def request_error(e: InvalidRequestError) -> APIError:
    """An engine validation error as a 400 whose param is the API's field name."""
    if e.field in ("height", "width"):
        return invalid("size", f"size: {e.field} {e.message}")
    return invalid(e.field, f"{e.field}: {e.message}")
