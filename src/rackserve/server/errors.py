"""The HTTP errors of the API: ``ApiError`` answers with OpenAI's error envelope, and
``as_api_error`` gives the status of each failure a request can meet in the engine."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from rackserve.server.async_client import (
    EngineDeadError,
    KVLoadFailedError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
    ServerShutdownError,
)
from rackserve.server.responses import error_body

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with OpenAI's envelope ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "authentication_error" if self.status == 401 else "invalid_request_error"

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def as_api_error(error: BaseException) -> ApiError:
    """The HTTP error for an exception raised while a request ran."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestRejectedError):
        return ApiError(400, str(error))
    if isinstance(error, ServerShutdownError):
        return ApiError(503, "The server shut down before this request finished.")
    if isinstance(error, EngineDeadError):
        # The reason (a traceback's last line) goes to the server log, not to clients.
        return ApiError(500, "The engine died while serving this request.")
    if isinstance(error, RequestAbortedError):
        return ApiError(499, str(error))
    if isinstance(error, KVLoadFailedError):  # the cause is the deployment's, not the input
        logger.error("%s", error)
        return ApiError(500, f"{error} (kv_load_failure_policy 'recompute' computes it here)")
    if isinstance(error, RequestFailedError):
        logger.error("request failed: %s", error)
        return ApiError(500, "Internal server error: this request's output could not be processed.")
    logger.error("request failed", exc_info=error)
    return ApiError(500, "Internal server error.")
