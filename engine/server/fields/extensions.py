"""ditserve's extension fields of every generation request, parsed in one place.

Image generations, image edits and video jobs all carry the same extensions beside their
OpenAI fields: ``loras`` (with OpenAI's ``model`` naming an adapter: ``fields.adapters``),
``priority``, ``deadline_s`` and ``step_cache`` (``fields.step_cache``). ``parse_extensions``
turns a validated body's values into the ``SamplingParams`` fields they set; ``form_value``
types a multipart form's text field as the JSON body would carry it (the extensions' and the
caller's own numbers and flags), so the edits route and the video jobs' form reader read
forms alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.request import LoraRef
from ditserve.engine.server.errors import invalid, shown
from ditserve.engine.server.fields.adapters import LoraSelection, parse_form_loras, resolve_adapters
from ditserve.engine.server.fields.step_cache import parse_field

# The extensions' form fields that are numbers (besides ``loras`` and ``step_cache``).
EXTENSION_INTEGERS = ("priority",)
EXTENSION_NUMBERS = ("deadline_s",)
# JSON numbers above this many digits are not read from form text (as JSON's own limit).
_FORM_NUMBER = re.compile(r"^[+-]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})"
                          r"(?:[eE][+-]?[0-9]{1,4})?$")


class ExtensionBody(Protocol):
    """A validated request body with the extension fields (and OpenAI's ``model``)."""

    model: str | None
    loras: list[LoraSelection] | None
    priority: int | None
    deadline_s: float | None
    step_cache: Any


@dataclass(frozen=True)
class Extensions:
    """The ``SamplingParams`` fields the extensions set."""

    loras: tuple[LoraRef, ...] = ()
    priority: int = 0
    deadline_s: float | None = None
    step_cache: StepCacheSpec | None = None

    def fields(self) -> dict[str, Any]:
        """As ``SamplingParams`` keyword arguments."""
        return {"loras": self.loras, "priority": self.priority, "deadline_s": self.deadline_s,
                "step_cache": self.step_cache}


def parse_extensions(body: ExtensionBody, *, engine: EngineClient,
                     model_name: str) -> Extensions:
    """The extensions of ``body``, or the API error: 404 for an adapter (or ``model``) this
    server does not serve, 400 for a malformed ``step_cache``."""
    loras = resolve_adapters(body.model, body.loras, engine=engine, model_name=model_name)
    return Extensions(loras=loras, priority=body.priority or 0, deadline_s=body.deadline_s,
                      step_cache=parse_field(body.step_cache))


def form_value(name: str, value: Any, *, integers: Collection[str] = (),
               numbers: Collection[str] = (), booleans: Collection[str] = ()) -> Any:
    """A form field's text as the type the JSON body would carry: ``loras`` as its list
    (``name[:scale],...`` or the JSON list as text), the extensions' and ``integers`` /
    ``numbers`` as numbers, ``booleans`` as true or false; other text as it is."""
    if not isinstance(value, str):  # an uploaded file where text belongs
        raise invalid(name, f"{name}: must be a text field, got a file upload")
    if name == "loras":
        return parse_form_loras(value)
    if name in booleans:
        flag = value.strip().lower()
        if flag not in ("true", "false"):
            raise invalid(name, f"{name}: must be true or false, got {shown(value)}")
        return flag == "true"
    whole = name in integers or name in EXTENSION_INTEGERS
    if not whole and name not in numbers and name not in EXTENSION_NUMBERS:
        return value
    text = value.strip()
    if not _FORM_NUMBER.match(text):
        raise invalid(name, f"{name}: must be {'an integer' if whole else 'a number'}, got "
                            f"{shown(value)}")
    if whole and re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text)
    number = float(text)
    if not math.isfinite(number):
        raise invalid(name, f"{name}: is out of range, got {shown(value)}")
    return number
