"""A request's LoRA selection: OpenAI's ``model`` naming an adapter (scale 1, as vLLM serves
LoRA modules as models) and ditserve's ``loras: [{"name", "scale"}]`` extension that stacks
several - resolved against the engine's adapter catalog (``engine.adapters.catalog``).

Used by the image and the video request parsers. An unknown adapter is a 404 with OpenAI's
error object (``model_not_found`` for ``model``, ``adapter_not_found`` for ``loras``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr

from ditserve.engine.errors import AdapterError, AdapterNotFoundError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.request import MAX_LORAS_PER_REQUEST, LoraRef
from ditserve.engine.server.errors import APIError, invalid, shown
from ditserve.engine.server.fields.body import Number


class LoraSelection(BaseModel):
    """One element of ``loras``: an adapter by name, at ``scale`` (default 1)."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    scale: Number | None = None


def resolve_adapters(model: str | None, loras: list[LoraSelection] | None, *, engine: EngineClient,
                     model_name: str) -> tuple[LoraRef, ...]:
    """The adapters a request selects (empty: the base model), or the API error."""
    catalog = engine.adapters
    selection: list[tuple[str, float]] = []
    if model is not None and model != model_name:
        if catalog is None or model not in catalog:
            adapters = "".join(f", {e.name!r}" for e in catalog.entries()) if catalog else ""
            raise APIError(404, f"model: {shown(model)} does not exist; this server serves "
                                f"{model_name!r}{adapters} (see GET /v1/models)",
                           param="model", code="model_not_found", reason="model_not_found")
        selection.append((model, 1.0))
    for item in loras or ():
        selection.append((item.name, 1.0 if item.scale is None else float(item.scale)))
    if not selection:
        return ()
    if catalog is None:
        raise APIError(404, "loras: this server has no LoRA adapters loaded", param="loras",
                       code="adapter_not_found", reason="model_not_found")
    try:
        return catalog.resolve(selection)
    except AdapterNotFoundError as e:
        raise APIError(404, f"loras: {e}", param="loras", code="adapter_not_found",
                       reason="model_not_found") from e
    except AdapterError as e:
        raise invalid("loras", f"loras: {e}") from e


# A form's adapters: "style:0.8,character" (what the OpenAPI form pattern describes), or the
# JSON body's list as text ('[{"name": "style", "scale": 0.8}]').
FORM_LORA = r"[A-Za-z0-9._-]+(:-?[0-9](\.[0-9]{1,3})?)?"
FORM_LORAS_PATTERN = f"^{FORM_LORA}(,{FORM_LORA}){{0,{MAX_LORAS_PER_REQUEST - 1}}}$"


def parse_form_loras(value: str) -> Any:
    """A multipart form's ``loras`` text as the JSON body's list (images edits, video jobs)."""
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise invalid("loras", "loras: not a JSON list; use name[:scale],... or "
                                   '[{"name": "style", "scale": 0.8}]') from e
    if not re.fullmatch(FORM_LORAS_PATTERN[1:-1], text):
        raise invalid("loras", f"loras: {shown(value)} is not name[:scale],... (at most "
                               f"{MAX_LORAS_PER_REQUEST}) nor a JSON list")
    selections = []
    for item in text.split(","):
        name, _, scale = item.partition(":")
        selections.append({"name": name, "scale": float(scale) if scale else None})
    return selections
