"""``GET /dashboard``: the page (it polls ``/v1/dashboard/data``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parents[1] / "static"

router = APIRouter()


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html")
