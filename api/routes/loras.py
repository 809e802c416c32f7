"""LoRA adapters at run time (vLLM's routes, admin keys only): register one for a served model, or
remove one. The registry (`worker.protocol.loras`, `{p}:loras`) is all they touch: a worker of the
base model loads an adapter when its first job comes, so an adapter is usable as soon as the route
answers. Any key without `admin=true` gets 403 `admin_required`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from ferry.api.auth import admin
from ferry.api.errors import ApiError
from ferry.api.openai_schemas import ModelCard
from ferry.api.schemas import error_responses
from ferry.api.services import Services, is_routable, served_model, services
from ferry.worker.protocol.fields import ModelName
from ferry.worker.protocol.loras import LoraEntry, LoraPath, add_lora_async, remove_lora_async

router = APIRouter(prefix="/v1", tags=["loras"], dependencies=[Depends(admin)])
Svc = Annotated[Services, Depends(services)]
TenantName = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: ModelName  # what requests name it by (`model`)
    lora_path: LoraPath  # an absolute local directory, s3://bucket/prefix/ or hf://org/name[@revision]
    base_model: ModelName | None = Field(None, description="the served model it applies to; "
                                         "required while more than one model is served")
    tenants: Annotated[list[TenantName], Field(min_length=1)] | None = Field(
        None, description="the tenants that may use and see it; unset: every tenant")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: ModelName


@router.post("/load_lora_adapter", response_model=ModelCard, responses=error_responses(401, 403, 404, 409, 422),
             summary="Register a LoRA adapter of a served model (vLLM's route)")
async def load_lora_adapter(body: LoadLoraAdapter, svc: Svc) -> ModelCard:
    """The same name and path again answers the adapter as it is (200); a name another path holds is a
    409 `lora_exists`, a served model's name a 409 `model_exists`."""
    if await is_routable(svc, body.lora_name):
        raise ApiError(409, "model_exists", f"lora_name: {body.lora_name!r} is a served model's name",
                       field="lora_name")
    base = await served_model(svc, body.base_model, field="base_model")
    entry = LoraEntry(name=body.lora_name, base_model=base, path=body.lora_path, tenants=body.tenants,
                      source="runtime")
    held = await add_lora_async(svc.redis, svc.keys, entry)
    await svc.heartbeats.refresh()  # this process lists it at once; the others within MODEL_CACHE_S
    if (held.path, held.base_model) != (entry.path, entry.base_model):
        raise ApiError(409, "lora_exists", f"lora_name: adapter {entry.name!r} is already registered with "
                       f"{held.path!r} for {held.base_model!r}; unload it first", field="lora_name")
    return ModelCard.of_lora(held)


@router.post("/unload_lora_adapter", responses=error_responses(401, 403, 404, 422),
             summary="Remove a LoRA adapter from the registry (vLLM's route)")
async def unload_lora_adapter(body: UnloadLoraAdapter, svc: Svc) -> dict[str, Any]:
    """New requests naming it are a 404 at once; workers that hold its weights drop them as newer
    adapters need the room."""
    if not await remove_lora_async(svc.redis, svc.keys, body.lora_name):
        raise ApiError(404, "model_not_found", f"adapter {body.lora_name!r} is not registered", field="lora_name")
    await svc.heartbeats.refresh()
    return {"id": body.lora_name, "object": "model", "deleted": True}
