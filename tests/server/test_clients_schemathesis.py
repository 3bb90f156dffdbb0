"""schemathesis over GET /openapi.json: generated requests (valid and invalid) to every documented operation get
no 5xx and no response that violates the documented schema, status code, content type or headers. The server
under test has a 64-token context so that generated generation requests stay short. A schema-valid request may
still be refused with a 400 (an unknown model name, an empty message list, a prompt longer than the context:
rules no JSON schema states), so schemathesis' positive-data-acceptance check is the one left out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from tests.support.examples import examples

pytestmark = pytest.mark.slow
MAX_EXAMPLES = examples(0.12)


@pytest.fixture(scope="module")
def small_server(default_model: LoadedModel) -> Iterator[str]:
    aengine = AsyncEngine(LLMEngine(default_model, EngineConfig(kv_memory="64MiB", max_model_len=64))).start()
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=served_name(default_model)))).start()
    yield thread.url
    thread.stop()
    aengine.shutdown()


def test_api_conforms_to_its_openapi_document(small_server: str) -> None:
    """Each operation in turn, MAX_EXAMPLES generated cases each (the pytest plugin of schemathesis does not load
    under this pytest, so cases are drawn with hypothesis directly)."""
    api = schemathesis.openapi.from_url(f"{small_server}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 12
    failures: list[str] = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate], database=None)
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        try:
            check()
        except Exception as exc:  # collect every operation's failure, then report them all
            failures.append(f"{op.method.upper()} {op.path}: {str(exc)[:2000]}")
    assert not failures, "\n\n".join(failures)
