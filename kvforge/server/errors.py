"""APIError: what a client caused (or must see), rendered in OpenAI's error shape.

Its own module so the request parsers (protocol.py, request_fields.py, structured_fields.py,
tools.py) can all raise it without importing each other in a circle.
"""
from __future__ import annotations


class APIError(Exception):
    """An error the client caused (or must see); rendered as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
