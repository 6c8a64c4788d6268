"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's dynamic LoRA routes, with
its body shapes (``{"lora_name", "lora_path"}``; ``{"lora_name"}``) and its plain-text
success answer.

Registered only when ``DITSERVE_ALLOW_RUNTIME_LORA_UPDATING`` is true (as vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a load reads a file of the server's host. Behind the API
key like every route. A load reads and checks the file (diffusers' converters,
``--max-lora-rank``) before the name becomes selectable; a name already loaded is refused
(409: unload it first). An unload is refused (409) while a running or queued request uses
the adapter. A file is checked against the served DiT too (every layer it names exists and
its factors fit), and the served model's own name is refused. Errors are OpenAI error
objects: 400 a bad body, an unusable file or the model's name, 404 a
missing file or an unknown name, 409 a name taken or an adapter in use.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.config.adapters import NAME_PATTERN, check_name
from ditserve.engine.errors import (
    AdapterConflictError,
    AdapterError,
    AdapterFileNotFoundError,
    AdapterNotFoundError,
    ConfigError,
)
from ditserve.engine.server import openapi
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.errors import APIError, invalid
from ditserve.engine.server.fields.body import decode_json, pydantic_error

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_api_key)])
RUNTIME_UPDATES_ENV = "DITSERVE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the operator enabled the load / unload routes."""
    return environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


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


def _json_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": False, "required": required,
        "properties": properties}}}}}


LOAD_BODY = _json_body({
    "lora_name": {"type": "string", "pattern": NAME_PATTERN.pattern,
                  "description": "the name requests select it by"},
    "lora_path": {"type": "string", "minLength": 1,
                  "description": "a .safetensors file on the server's host, or a directory "
                                 "holding one"},
    "load_inplace": {"type": ["boolean", "null"], "description": "vLLM's; ignored"},
}, ["lora_name", "lora_path"])
UNLOAD_BODY = _json_body({
    "lora_name": {"type": "string"},
    "lora_int_id": {"type": ["integer", "null"], "description": "vLLM's; ignored"},
}, ["lora_name"])


@router.post("/v1/load_lora_adapter", response_model=None, summary="Load a LoRA adapter",
             openapi_extra=LOAD_BODY,
             responses=openapi.answers({"text/plain": {"type": "string"}}, 404, 409, 503,
                                       descriptions={
                 404: "The adapter file does not exist",
                 409: "An adapter of that name is already loaded"}))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _body(request, LoadLoraAdapterRequest)
    assert isinstance(body, LoadLoraAdapterRequest)
    catalog = _catalog(request)
    model_name = request.app.state.server.model_name
    if body.lora_name == model_name:
        # ``model`` selects an adapter by name: this one could never be selected.
        raise invalid("lora_name", f"{body.lora_name!r} is the served model's name; give "
                                   "the adapter another name", code="adapter_name_taken")
    try:
        check_name(body.lora_name)
    except ConfigError as e:
        raise invalid("lora_name", str(e)) from e
    try:
        entry = await asyncio.to_thread(catalog.load, body.lora_name, body.lora_path)
    except AdapterFileNotFoundError as e:
        raise APIError(404, str(e), param="lora_path", code="adapter_file_not_found",
                       reason="model_not_found") from e
    except AdapterConflictError as e:
        raise APIError(409, str(e), param="lora_name", code="adapter_exists",
                       reason="conflict") from e
    except AdapterError as e:  # the name passed above: what is refused is the file
        raise invalid("lora_path", str(e)) from e
    log.info("LoRA adapter %s loaded from %s (rank %d)", entry.name, entry.path, entry.rank)
    return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' added successfully.")


disabled_router = APIRouter(dependencies=[Depends(require_api_key)])


@disabled_router.post("/v1/load_lora_adapter", include_in_schema=False)
@disabled_router.post("/v1/unload_lora_adapter", include_in_schema=False)
async def runtime_updates_off(request: Request) -> None:
    """The routes of a server started without the variable: a 404 that says how to turn
    them on (an unexplained 404 reads as a wrong URL)."""
    raise APIError(404, f"runtime LoRA loading is off on this server; start it with "
                        f"{RUNTIME_UPDATES_ENV}=true to enable {request.url.path}, or name "
                        "adapters at start with --lora-modules",
                   code="not_found", reason="not_found")


@router.post("/v1/unload_lora_adapter", response_model=None, summary="Unload a LoRA adapter",
             openapi_extra=UNLOAD_BODY,
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
    except AdapterError as e:  # in use, or fused into the weights
        code = "adapter_in_use" if isinstance(e, AdapterConflictError) else "adapter_fused"
        raise APIError(409, str(e), param="lora_name", code=code, reason="conflict") from e
    log.info("LoRA adapter %s unloaded", entry.name)
    return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' removed successfully.")
