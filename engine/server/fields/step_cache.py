"""The ``step_cache`` extension field of image requests and video jobs: its parsing into the
engine's ``StepCacheSpec`` and its OpenAPI schema (docs/step_cache.md).

JSON bodies carry an object, ``{"policy": "first-block", "threshold": 0.08}`` or
``{"policy": "every", "every": 3}``; a form field (video jobs) carries the same object as JSON
text, or a bare policy name (``"teacache"``, ``"every=3"``, ``"none"``). Omitted or null: the
server's default (``--step-cache``); ``{"policy": "none"}`` turns a default off.
"""

from __future__ import annotations

import json
from typing import Any

from ditserve.engine.config.step_cache import (
    MAX_EVERY,
    MAX_THRESHOLD,
    OFF,
    POLICIES,
    StepCacheSpec,
    parse_step_cache,
)
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.server.errors import invalid

DESCRIPTION = ("reuse the DiT's residual across steps: first-block (threshold: the first "
               "block's relative change under which the other blocks are skipped), teacache "
               "(Flux, Wan2.1; threshold: the accumulated rescaled change), every (every: "
               "compute one step in K); 'none' turns the server's default off; omitted: the "
               "server's default")


def parse_field(value: Any) -> StepCacheSpec | None:
    """The field's spec, or a 400 naming ``step_cache``."""
    if isinstance(value, str) and value.lstrip().startswith("{"):  # a form's JSON text
        try:
            value = json.loads(value)
        except ValueError as e:
            raise invalid("step_cache", f"step_cache: is not a valid JSON object: {e}") from e
    try:
        return parse_step_cache(value)
    except InvalidRequestError as e:
        raise invalid("step_cache", f"step_cache: {e.message}") from e


def step_cache_policies(engine: EngineClient) -> tuple[str, ...]:
    """The policies the engine's model takes."""
    return tuple(engine.step_cache_policies)


def form_schema(policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """The text form: a policy name or ``every=K`` (a form may also carry the JSON object)."""
    names = [*policies, OFF] + (["every=([1-9][0-9]?|100)"] if "every" in policies else [])
    return {"type": "string", "description": "a policy name, or 'every=K'",
            "pattern": f"^({'|'.join(names)})$"}


def openapi_schema(policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Exactly what ``parse_field`` accepts (a schema-valid value is never refused)."""
    threshold = {"type": "number", "minimum": 0, "maximum": MAX_THRESHOLD,
                 "description": "first-block (default 0.08) and teacache (default 0.4 Flux, "
                                "0.2 Wan); 0 never reuses"}
    every = {"type": "integer", "minimum": 1, "maximum": MAX_EVERY,
             "description": "compute one step in K between the first and last 2 (default 2); "
                            "1 never reuses"}

    thresholded = [p for p in policies if p != "every"]

    def shape(names: list[str], **extra: Any) -> dict[str, Any]:
        knobs = {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in extra.items()}
        return {"type": "object", "additionalProperties": False, "required": ["policy"],
                "properties": {"policy": {"enum": names}, **knobs}}

    return {
        "description": DESCRIPTION,
        "oneOf": [
            form_schema(policies),
            *([shape(thresholded, threshold=threshold)] if thresholded else []),
            *([shape(["every"], every=every)] if "every" in policies else []),
            shape([OFF]),
        ],
    }
