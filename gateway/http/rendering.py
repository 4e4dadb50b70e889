"""JSON responses rendered with orjson (numpy arrays serialised without a Python list detour)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, option=_OPTIONS)


def json_response(content: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(dumps(content), status, headers, media_type="application/json")
