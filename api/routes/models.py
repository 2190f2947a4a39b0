"""Models that workers serve."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.deps import ServicesDep, get_caller
from shared.schemas import ModelView

router = APIRouter(tags=["models"], dependencies=[Depends(get_caller)])


@router.get("/models", response_model=list[ModelView])
def list_models(services: ServicesDep, include_offline: bool = False) -> list[ModelView]:
    """Models with live workers (all known models with include_offline=true), modules in forward
    order, each with the hooks a capture may name and their widths (what capture validation accepts)."""
    views = []
    for name in services.registry.names():
        info = services.registry.get(name)
        live = len(services.registry.live_workers(name))
        if info is None or (live == 0 and not include_offline):
            continue
        views.append(
            ModelView(
                name=info.name,
                live_workers=live,
                architecture=info.architecture,
                num_layers=info.num_layers,
                hidden_size=info.hidden_size,
                max_context=info.max_context,
                dtype=info.dtype,
                chat_template=info.chat_template,
                tool_format=info.tool_format,
                tool_template=info.tool_template,
                presets=info.presets,
                modules=[m.path for m in info.modules],
                hooks={m.path: m.hooks() for m in info.modules},
                last_position_only=[m.path for m in info.modules if not m.all_positions],
                not_capturable=info.not_capturable,
                decoding=info.decoding,
            )
        )
    return views
