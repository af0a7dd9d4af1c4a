"""Schemathesis against the admin API's own OpenAPI document, served by a real vault on a real
database: every response must be one the document describes (status, content type, body
schema), no input may cause a 5xx, schema-invalid input must be refused and schema-valid
input accepted. The one known exception: JSON Schema cannot say "in the future", so a
schema-valid key whose `expires_at` has passed is refused with 422, and only for that field.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from schemathesis import GenerationMode

from vault import admin
from vault.app import VERSION, serve
from vault.models import new_key_id
from vault.openapi import openapi_document
from vault.settings import VaultSettings

from .support import ADMIN_TOKEN, MAX_CAP_CENTS

# Few examples per operation keep the suite fast; raise it locally for a deeper search.
EXAMPLES = 12
AdminCase = schemathesis.Case[Any]
FAST = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


@contextmanager
def vault_in_thread(vault_settings: VaultSettings) -> Iterator[str]:
    """The vault on its own event loop in a thread: schemathesis calls it synchronously, and
    a vault on the test's loop would never get to answer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vault", daemon=True)
    thread.start()
    serving = serve(vault_settings)
    try:
        running = asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result(30)
        try:
            yield running.url
        finally:
            asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture
def vault_url(vault_settings: VaultSettings) -> Iterator[str]:
    with vault_in_thread(vault_settings) as url:
        yield url


# The document the vault serves, from the same code and ceiling as the vault under test
# (test_the_served_document_is_the_one_fuzzed checks they are equal).
DOCUMENT = openapi_document(admin.OPERATIONS, VERSION, MAX_CAP_CENTS)
schema = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {ADMIN_TOKEN}"},
            "generation": {"max-examples": EXAMPLES},
            "operations": [
                {
                    "include-operation-id": "issueKey",
                    "checks": {
                        "positive_data_acceptance": {"expected-statuses": ["2xx", "401", "422"]}
                    },
                }
            ],
        }
    ),
)


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: AdminCase, **kwargs: Any) -> None:
    """A fresh id for each key a valid request issues: the fuzz draws the same ids again,
    and a key id taken (409) made a stateful run replay differently from its first run
    (hypothesis's FlakyStrategyDefinition), while the 409 itself is the documented answer."""
    positive = case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE
    issues = (case.method, case.path) == ("POST", "/vault/keys")
    if issues and positive and isinstance(case.body, dict) and "key_id" in case.body:
        case.body["key_id"] = new_key_id()


@pytest.fixture
def admin_api(vault_url: str) -> schemathesis.BaseSchema:
    schema.config.update(base_url=vault_url)
    return schema


def test_the_served_document_is_the_one_fuzzed(vault_url: str) -> None:
    served = requests.get(vault_url + "/vault/openapi.json", timeout=10).json()
    assert served == json.loads(json.dumps(DOCUMENT))


def _refused_only_where_the_schema_cannot_say(
    case: AdminCase, response: schemathesis.Response
) -> None:
    """A body the schema allows is refused only for what JSON Schema cannot express: an
    expiry in the past, a daily cap above the cap."""
    if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
        return
    if response.status_code == 422:
        fields = {problem["field"] for problem in response.json()["error"]["fields"]}
        body = case.body if isinstance(case.body, dict) else {}
        daily, cap = body.get("daily_cap_cents"), body.get("cap_cents")
        # Integral floats (1.0) are integers here too.
        above = isinstance(daily, int | float) and isinstance(cap, int | float) and daily > cap
        assert fields <= {"expires_at"} | ({"daily_cap_cents"} if above else set()), response.text
        assert fields, response.text


@schema.parametrize()
@FAST
def test_every_operation_answers_as_documented(case: AdminCase, vault_url: str) -> None:
    response = case.call_and_validate(base_url=vault_url)
    _refused_only_where_the_schema_cannot_say(case, response)


def test_chained_calls_on_issued_keys_answer_as_documented(
    admin_api: schemathesis.BaseSchema, vault_url: str
) -> None:
    # Links in the document feed an issued key's id to getKey, revoke, audit, ...: the
    # key-scoped operations are exercised on keys that exist, not only on 404s.
    machine = admin_api.as_state_machine()
    run_state_machine_as_test(
        machine,
        settings=settings(FAST, max_examples=EXAMPLES, stateful_step_count=6),
    )
    found = requests.get(
        vault_url + "/vault/keys", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    )
    assert found.json()["keys"], "the state machine never issued a key"
