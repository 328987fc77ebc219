"""pyserve's HTTP API (OpenAI and native routes) as an aiohttp application over an Engine."""

from pyserve.http.app import create_app, server_state

__all__ = ["create_app", "server_state"]
