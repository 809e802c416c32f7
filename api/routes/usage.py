"""`GET /v1/usage`: the caller's usage, counted from its jobs that ended (`api.usage`)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from ferry.api.auth import tenant
from ferry.api.schemas import error_responses
from ferry.api.services import Services, services
from ferry.api.usage import read_usage
from ferry.worker.protocol.usage import USAGE_DAYS_KEPT

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", responses=error_responses(401, 422), summary="The caller's requests and tokens, in total and per day")
async def usage(svc: Annotated[Services, Depends(services)], tenant_name: Annotated[str, Depends(tenant)],
                days: Annotated[int, Query(ge=1, le=USAGE_DAYS_KEPT, description="UTC days to list, today last")] = 7,
                ) -> dict[str, Any]:
    total, per_day = await read_usage(svc.redis, svc.keys, tenant_name, days, time.time())
    return {"object": "usage", "tenant": tenant_name, "totals": total.as_json(),
            "days": [{"date": date, **counts.as_json()} for date, counts in per_day]}
