"""Loading and unloading LoRA adapters while the server runs (vLLM's endpoints and bodies;
only with `--enable-lora-loading`: without it the routes do not exist, a 404 as in vLLM).

POST /v1/load_lora_adapter `{"lora_name", "lora_path"}`: `lora_path` must lie inside the
server's LoRA directory (symlinks and `..` resolved; 400 naming `lora_path` otherwise);
the engine checks the adapter against the base (400 naming the field or tensor); a name
already served is a 400 naming `lora_name`. The adapter gets an id never used before.
POST /v1/unload_lora_adapter `{"lora_name"}`: 404 for a name not loaded; requests already
running under it finish under it, new ones naming it get 404 `model_not_found`.
Both answer 200 with vLLM's plain-text "Success: ..." line.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedllm.engine.engine_client import EngineClient
from pagedllm.entrypoints.server.auth import ApiKey
from pagedllm.entrypoints.server.body import RequestReader
from pagedllm.entrypoints.server.errors import APIError, from_invalid_param
from pagedllm.entrypoints.server.lora_modules import ServedModels, check_lora_path
from pagedllm.errors import InvalidParameterError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's body has it; the name decides here


def lora_router(
    engine: EngineClient,
    models: ServedModels,
    reader: RequestReader,
    lora_dir: str,
    api_key: ApiKey,
) -> APIRouter:
    """POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter, behind the key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key)])

    @v1.post("/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        body = await reader.read(request, LoadLoRAAdapterRequest)
        try:
            path = check_lora_path(body.lora_path, lora_dir)
            lora = models.new_request(body.lora_name, path)
            await engine.check_lora(lora)
            try:
                models.add(lora)  # checks the name again: another load may have taken it
            except InvalidParameterError:
                await engine.remove_lora(lora.lora_int_id)  # the engine forgets it too
                raise
        except InvalidParameterError as exc:
            raise from_invalid_param(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        body = await reader.read(request, UnloadLoRAAdapterRequest)
        try:
            lora = models.remove(body.lora_name)
        except KeyError:
            raise APIError(
                404,
                f"the LoRA adapter '{body.lora_name}' is not loaded",
                param="lora_name",
                code="lora_not_found",
            ) from None
        # Requests already queued under it finish; the engine never serves its id again.
        await engine.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    return v1
