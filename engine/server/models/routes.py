"""GET /v1/models and GET /v1/models/{id}: the served model, in OpenAI's model format, with
ditserve's own ``ditserve`` object: what the replica makes (``output``; ``images``: whether
it serves /v1/images/generations, a video model's still images included), what a request may
ask of it (the loaded model's limits within the server's flags: sizes, frames, steps, prompt
length) and its defaults. The same limits are in the OpenAPI document's request schemas. Its LoRA
adapters follow as models of their own, whose card has ``parent`` (the base model) and
``root`` (the adapter's file), as vLLM lists LoRA modules."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from ditserve.engine.server import openapi
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.errors import APIError, shown
from ditserve.engine.server.state import ServerState

CREATED = int(time.time())

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": CREATED,
            "owned_by": "ditserve", "ditserve": served(state)}


def served(state: ServerState) -> dict[str, Any]:
    """What this replica makes and what a request may ask of it."""
    model = state.model_limits()
    facts = state.engine.facts()
    images = state.limits()
    width, height = images.default_size
    limits: dict[str, Any] = {
        "pixel_multiple": images.pixel_multiple, "max_width": images.max_side,
        "max_height": images.max_side, "max_steps": images.max_steps,
        "max_prompt_chars": images.max_prompt_chars, "positions": model.positions}
    defaults: dict[str, Any] = {"size": f"{width}x{height}", "steps": images.default_steps,
                                "guidance_scale": images.default_guidance}
    if state.videos is not None:
        video = state.video_limits()
        limits.update(frame_step=video.frame_step, min_frames=video.min_frames,
                      max_frames=video.max_frames, max_seconds=round(video.max_seconds, 6))
        defaults.update(num_frames=video.default_frames, fps=video.default_fps)
    return {"output": state.output, "images": state.makes_images, "loaded": facts is not None, "limits": limits,
            "defaults": defaults, "adapters": list(facts.adapters) if facts else []}


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """One card per served LoRA adapter (none before the engine has loaded)."""
    catalog = state.engine.adapters
    return [{"id": entry.name, "object": "model", "created": CREATED, "owned_by": "ditserve",
             "parent": state.model_name, "root": entry.path}
            for entry in (catalog.entries() if catalog is not None else ())]


@router.get("/v1/models", response_model=None, summary="The served model and its adapters",
            responses=openapi.answers(openapi.json_answer("ModelList")))
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state.server
    return {"object": "list", "data": [model_card(state), *adapter_cards(state)]}


@router.get("/v1/models/{model_id:path}", response_model=None, summary="One model by id",
            responses=openapi.answers(openapi.json_answer("Model"), 404))
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    name = state.model_name
    adapter = next((c for c in adapter_cards(state) if c["id"] == model_id), None)
    if adapter is not None:
        return adapter
    if model_id != name:
        raise APIError(404, f"model {shown(model_id)} does not exist; this server serves "
                            f"{name!r}", param="model", code="model_not_found",
                       reason="model_not_found")
    return model_card(state)
