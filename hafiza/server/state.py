"""What every route shares: the engine, the settings, the metrics and the cache explainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from prometheus_client import CollectorRegistry

from hafiza.engine.async_engine import AsyncEngine
from hafiza.models.tokenizer import Tokenizer
from hafiza.server.errors import ApiError
from hafiza.server.explain import CacheExplainer
from hafiza.server.metrics import ServerMetrics
from hafiza.server.settings import CHARS_PER_CONTEXT_TOKEN, ServerSettings

if TYPE_CHECKING:
    from hafiza.server.pd import PDWorker
    from hafiza.store.connector import StoreConnector


@dataclass
class ServerState:
    """Lives on `app.state.hafiza`; routes added later (dashboard, store) find everything here. `store` is the KV
    store's connector when one is attached (`hafiza.server.store.serve_store`)."""

    aengine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    explainer: CacheExplainer
    store: StoreConnector | None = None
    pd: PDWorker | None = None  # a prefill or decode worker's side of the split (None: --role both)

    @classmethod
    def create(cls, aengine: AsyncEngine, settings: ServerSettings,
               registry: CollectorRegistry | None = None) -> ServerState:
        engine = aengine.engine
        if settings.max_prompt_chars is None:  # a prompt this long could not fit the context anyway
            settings.max_prompt_chars = CHARS_PER_CONTEXT_TOKEN * engine.max_model_len
        metrics = ServerMetrics(aengine.stats, settings.model_name, settings.prices, registry)
        aengine.admission_listeners.append(metrics.queue_time.observe)
        explainer = CacheExplainer(engine.layout.block_size, settings.explain_history, settings.explain_details)
        return cls(aengine, settings, metrics, explainer)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.aengine.engine.tokenizer

    @property
    def block_size(self) -> int:
        return self.aengine.engine.layout.block_size

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len

    @property
    def role(self) -> str:
        """This worker's part in a prefill/decode split: prefill, decode or both."""
        return self.pd.role if self.pd is not None else "both"

    @property
    def fingerprint(self) -> str:
        return self.aengine.engine.loaded.fingerprint

    def check_model(self, name: str) -> None:
        """400 unless `name` is the served model (or one of its aliases)."""
        if not self.settings.accepts_model(name):
            raise ApiError(400, f"model {name!r} is not served here: use {self.settings.model_name!r} "
                                f"(see GET /v1/models)", param="model", code="model_not_found")


def server_state(request: Request) -> ServerState:
    return request.app.state.hafiza
