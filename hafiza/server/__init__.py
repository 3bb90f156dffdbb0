"""HTTP server: the Anthropic Messages and OpenAI Chat Completions APIs over one engine, with metrics."""

from hafiza.server.app import create_app
from hafiza.server.settings import PriceTable, ServerSettings
from hafiza.server.state import ServerState

__all__ = ["PriceTable", "ServerSettings", "ServerState", "create_app"]
