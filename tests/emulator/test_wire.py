"""Auth, Stripe's wire format (form decoding, JSON shape, errors), pagination and expansion."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import stripe

from stripe_emulator.errors import StripeError
from stripe_emulator.forms import decode

from .support import API_KEY, Raw

# Built, not written out: no live-key pattern in the repository, even a fake one.
LIVE_PREFIX = "sk_" + "live_"


def test_forms_decode_nested_hashes_and_arrays() -> None:
    assert decode(
        "amount=100&metadata[billing_key]=k&metadata[0]=zero&expand[0]=a&expand[1]=b"
        "&invoice_settings[default_payment_method]=pm_x&tags[]=x&tags[]=y&blank="
    ) == {
        "amount": "100",
        "metadata": {"billing_key": "k", "0": "zero"},  # metadata keys are never indices
        "expand": ["a", "b"],
        "invoice_settings": {"default_payment_method": "pm_x"},
        "tags": ["x", "y"],
        "blank": "",
    }


@pytest.mark.parametrize("encoded", ["a=1&a[b]=2", "a[b]=1&a=2", "a[]=1&a[x]=2"])
def test_forms_decode_refuses_mixed_shapes(encoded: str) -> None:
    with pytest.raises(StripeError) as caught:
        decode(encoded)
    assert caught.value.status == 400
    assert caught.value.error["param"] == "a"


async def test_missing_key_is_401_in_stripes_shape(raw: Raw) -> None:
    reply = await raw.get("/v1/customers", key=None)
    assert reply.status == 401
    assert reply.body["error"]["type"] == "invalid_request_error"
    assert "API key" in reply.body["error"]["message"]
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer " + LIVE_PREFIX + "51Habcdefghijklmn1234",
        "Bearer pk_test_51Habcdefghijklmn1234",
        "Bearer sk_test_",
        "Token sk_test_51Habcdefghijklmn1234",
        "Basic !!!",
    ],
)
async def test_other_keys_are_401_and_never_echoed(raw: Raw, authorization: str) -> None:
    reply = await raw.get("/v1/customers", key=None, headers={"Authorization": authorization})
    assert reply.status == 401
    assert "51Habcdefghijklmn" not in json.dumps(reply.body)


async def test_basic_auth_with_the_key_as_user_is_accepted(raw: Raw) -> None:
    token = base64.b64encode(f"{API_KEY}:".encode()).decode()
    reply = await raw.get("/v1/customers", key=None, headers={"Authorization": f"Basic {token}"})
    assert reply.status == 200


async def test_sdk_raises_authentication_error(emulator: object, raw: Raw) -> None:
    client = stripe.StripeClient(LIVE_PREFIX + "nope1234", base_addresses={"api": raw.url})
    with pytest.raises(stripe.AuthenticationError) as caught:
        await asyncio.to_thread(client.v1.customers.list)
    assert caught.value.http_status == 401


async def test_objects_have_stripes_shape_and_headers(raw: Raw) -> None:
    reply = await raw.post("/v1/customers", {"email": "a@example.com"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.headers["Request-Id"].startswith("req_")
    customer = reply.body
    assert customer["object"] == "customer"
    assert customer["id"].startswith("cus_")
    assert isinstance(customer["created"], int)
    assert customer["livemode"] is False
    assert customer["email"] == "a@example.com"


async def test_unknown_url_is_404(raw: Raw) -> None:
    reply = await raw.get("/v1/widgets/1")
    assert reply.status == 404
    assert reply.body["error"]["type"] == "invalid_request_error"
    assert "Unrecognized request URL" in reply.body["error"]["message"]


async def test_unknown_parameter_is_refused(raw: Raw) -> None:
    reply = await raw.post("/v1/customers", {"emial": "typo@example.com"})
    assert reply.status == 400
    assert reply.body["error"]["code"] == "parameter_unknown"
    assert reply.body["error"]["param"] == "emial"


async def test_list_is_newest_first_with_cursors(raw: Raw) -> None:
    ids = [(await raw.post("/v1/customers", {})).body["id"] for _ in range(5)]
    newest_first = ids[::-1]
    first = (await raw.get("/v1/customers", {"limit": "2"})).body
    assert first["object"] == "list"
    assert first["url"] == "/v1/customers"
    assert [c["id"] for c in first["data"]] == newest_first[:2]
    assert first["has_more"] is True
    second = (await raw.get("/v1/customers", {"limit": "2", "starting_after": ids[3]})).body
    assert [c["id"] for c in second["data"]] == newest_first[2:4]
    last = (await raw.get("/v1/customers", {"limit": "2", "starting_after": ids[1]})).body
    assert [c["id"] for c in last["data"]] == newest_first[4:]
    assert last["has_more"] is False
    back = (await raw.get("/v1/customers", {"limit": "2", "ending_before": ids[0]})).body
    assert [c["id"] for c in back["data"]] == [ids[2], ids[1]]
    assert back["has_more"] is True


@pytest.mark.parametrize(
    ("query", "param", "code"),
    [
        ({"limit": "0"}, "limit", "parameter_invalid_integer"),
        ({"limit": "101"}, "limit", "parameter_invalid_integer"),
        ({"starting_after": "cus_missing"}, "starting_after", "resource_missing"),
    ],
)
async def test_list_parameters_are_validated(
    raw: Raw, query: dict[str, str], param: str, code: str
) -> None:
    reply = await raw.get("/v1/customers", query)
    assert reply.status == 400
    assert (reply.body["error"]["param"], reply.body["error"]["code"]) == (param, code)


async def test_sdk_auto_paging_walks_every_page(sdk: stripe.StripeClient, raw: Raw) -> None:
    ids = [(await raw.post("/v1/customers", {})).body["id"] for _ in range(7)]
    page = await sdk.v1.customers.list_async(params={"limit": 3})
    seen = [customer.id async for customer in page.auto_paging_iter()]
    assert seen == ids[::-1]


async def test_expand_replaces_ids_by_objects(raw: Raw) -> None:
    customer = await raw.customer()
    reply = await raw.charge(customer, "expand-1", **{"expand[0]": "latest_charge"})
    assert reply.body["latest_charge"]["object"] == "charge"
    listed = await raw.get(
        "/v1/payment_intents",
        {"customer": customer["id"], "expand[]": "data.customer"},
    )
    assert listed.body["data"][0]["customer"]["id"] == customer["id"]
    nested = await raw.get(
        f"/v1/customers/{customer['id']}",
        {"expand[]": "invoice_settings.default_payment_method"},
    )
    method = nested.body["invoice_settings"]["default_payment_method"]
    assert method["object"] == "payment_method"


async def test_bad_expand_is_refused_before_anything_is_charged(raw: Raw) -> None:
    customer = await raw.customer()
    reply = await raw.charge(customer, "expand-2", **{"expand[0]": "latest_chrage"})
    assert reply.status == 400
    assert reply.body["error"]["param"] == "expand"
    assert (await raw.ledger())["charges"] == []
