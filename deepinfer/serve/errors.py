"""OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``, raised as ``APIError``."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def __reduce__(self):  # it crosses from the engine's process to the server's (``engine_process.py``)
        return APIError, (self.status, self.message, self.param, self.type, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


# SamplingParams' messages open with the field they refuse ("temperature must be >= 0, got -1"); the HTTP field of
# the same value is named differently for two of them
_HTTP_NAMES = {"seq_seed": "seed", "so_args": "response_format"}
_FIELD = re.compile(r"^([a-z_]+)(?:\[[^\]]*\])? ")


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 for ``message``; ``param`` defaults to the field the message opens with, if any."""
    if param is None:
        match = _FIELD.match(message)
        param = _HTTP_NAMES.get(match.group(1), match.group(1)) if match else None
    return APIError(400, message, param)


def unsupported(field: str, why: str = "") -> APIError:
    return APIError(400, f"{field} is not supported by deepinfer serve yet{': ' + why if why else ''}", field,
                    code="unsupported_parameter")
