"""A chat template that refuses the messages (Mistral's refuses a system turn and roles that do not
alternate, through jinja2's TemplateError) is the client's 400 naming it, never a 500; the engine
serves on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.api.app import create_app  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from elastune_worker.engine.frontend.serving_client import EngineServingClient  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402

MODEL = "tiny-llama"
STRICT = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def client() -> Iterator[EngineServingClient]:
    engine = AsyncEngine(LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), EngineConfig(device="cpu")))
    try:
        serving = EngineServingClient(engine, MODEL)
        serving.tokenizer.chat_template = STRICT  # this engine's own tokenizer object
        yield serving
    finally:
        engine.close()


def test_a_refused_conversation_is_a_400_naming_the_template_and_the_next_one_is_served(
    client: EngineServingClient,
) -> None:
    app = create_app(lambda: client)

    async def main() -> list[Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=120) as http:
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
            bad = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 km →"}]
            refused = await http.post("/v1/chat/completions", json=body | {"messages": bad})
            served = await http.post("/v1/chat/completions", json=body | {"messages": bad[1:]})
            return [refused, served]

    refused, served = asyncio.run(main())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "messages"
    assert "chat template refused these messages: System role not supported" in error["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] >= 1
