"""Errors every layer may raise and the server maps to HTTP answers."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the request field to change (for a 400's param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
