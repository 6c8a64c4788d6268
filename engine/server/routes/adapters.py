"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's dynamic LoRA routes, with
its body shapes (``{"lora_name", "lora_path"}``; ``{"lora_name"}``) and its plain-text
success answer.

Behind the API key like every route. A load reads and checks the file (diffusers' converters,
``--max-lora-rank``) before the name becomes selectable; a name already loaded is refused
(unload it first). An unload is refused (409) while a running or queued request uses the
adapter. Errors are OpenAI error objects: 400 bad body or file, 404 unknown name, 409 in use.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.errors import AdapterError, AdapterNotFoundError
from ditserve.engine.server import openapi
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.errors import APIError, invalid
from ditserve.engine.server.schemas import decode_json, pydantic_error

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_api_key)])


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: bool | None = None  # vLLM's flag; a loaded name is refused either way


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # vLLM's; names identify adapters here


def _catalog(request: Request):  # type: ignore[no-untyped-def]
    catalog = request.app.state.server.engine.adapters
    if catalog is None:
        raise APIError(503, "the engine is not started yet; retry when /ready answers 200",
                       type="server_error", code="not_ready", reason="unavailable")
    return catalog


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    data = decode_json(await request.body())
    if not isinstance(data, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except PydanticValidationError as e:
        raise pydantic_error(e, fields=tuple(model.model_fields)) from e


@router.post("/v1/load_lora_adapter", response_model=None, summary="Load a LoRA adapter",
             responses=openapi.answers({"text/plain": {"type": "string"}}, 503))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _body(request, LoadLoraAdapterRequest)
    assert isinstance(body, LoadLoraAdapterRequest)
    catalog = _catalog(request)
    try:
        entry = await asyncio.to_thread(catalog.load, body.lora_name, body.lora_path)
    except AdapterError as e:
        raise invalid("lora_path" if "file" in str(e) else "lora_name", str(e)) from e
    log.info("LoRA adapter %s loaded from %s (rank %d)", entry.name, entry.path, entry.rank)
    return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, summary="Unload a LoRA adapter",
             responses=openapi.answers({"text/plain": {"type": "string"}}, 404, 409, 503,
                                             descriptions={
                 404: "No adapter of that name is loaded",
                 409: "A running or queued request uses the adapter"}))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _body(request, UnloadLoraAdapterRequest)
    assert isinstance(body, UnloadLoraAdapterRequest)
    catalog = _catalog(request)
    try:
        entry = catalog.unload(body.lora_name)
    except AdapterNotFoundError as e:
        raise APIError(404, str(e), param="lora_name", code="adapter_not_found",
                       reason="model_not_found") from e
    except AdapterError as e:
        raise APIError(409, str(e), param="lora_name", code="adapter_in_use",
                       reason="conflict") from e
    log.info("LoRA adapter %s unloaded", entry.name)
    return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' removed successfully.")
