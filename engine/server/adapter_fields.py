"""A request's LoRA selection: OpenAI's ``model`` naming an adapter (scale 1, as vLLM serves
LoRA modules as models) and ditserve's ``loras: [{"name", "scale"}]`` extension that stacks
several - resolved against the engine's adapter catalog (``engine.adapters.catalog``).

Used by the image and the video request parsers. An unknown adapter is a 404 with OpenAI's
error object (``model_not_found`` for ``model``, ``adapter_not_found`` for ``loras``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict, StrictStr

from ditserve.engine.errors import AdapterError, AdapterNotFoundError
from ditserve.engine.request import LoraRef
from ditserve.engine.server.errors import APIError, invalid, shown

Number = Annotated[float, Strict()]


class LoraSelection(BaseModel):
    """One element of ``loras``: an adapter by name, at ``scale`` (default 1)."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    scale: Number | None = None


def resolve_adapters(model: str | None, loras: list[LoraSelection] | None, *, engine: Any,
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
