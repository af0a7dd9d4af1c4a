"""`billing.sealing`: what seals the period keys' secrets in the ledger database."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from billing.config import BillingSettings
from billing.sealing import SecretBox, UnsealError, new_key

SECRET = SecretStr("vk_" + "s3cr3t" * 8)


def test_a_sealed_secret_opens_and_does_not_hold_the_secret() -> None:
    box = SecretBox(SecretStr(new_key()))
    sealed = box.seal(SECRET)
    assert SECRET.get_secret_value().encode() not in sealed
    assert box.open(sealed, "the key").get_secret_value() == SECRET.get_secret_value()
    # Each seal is fresh (random IV): two rows never show they hold the same secret.
    assert box.seal(SECRET) != sealed


def test_a_new_key_first_seals_and_the_old_one_still_opens() -> None:
    old, new = new_key(), new_key()
    sealed_before = SecretBox(SecretStr(old)).seal(SECRET)
    rotated = SecretBox(SecretStr(f"{new}, {old},"))
    assert rotated.open(sealed_before, "the key") == SECRET
    # What the rotated box seals needs the new key.
    with pytest.raises(UnsealError):
        SecretBox(SecretStr(old)).open(rotated.seal(SECRET), "the key")
    assert SecretBox(SecretStr(new)).open(rotated.seal(SECRET), "the key") == SECRET


def test_reseal_moves_a_secret_to_the_first_key_and_leaves_one_already_there() -> None:
    old, new = new_key(), new_key()
    sealed_before = SecretBox(SecretStr(old)).seal(SECRET)
    rotated = SecretBox(SecretStr(f"{new},{old}"))
    again = rotated.reseal(sealed_before)
    assert again is not None and SecretBox(SecretStr(new)).open(again, "the key") == SECRET
    assert rotated.reseal(again) == again
    assert SecretBox(SecretStr(new_key())).reseal(sealed_before) is None


def test_a_missing_key_or_an_altered_row_is_a_clear_error_without_the_secret() -> None:
    sealed = SecretBox(SecretStr(new_key())).seal(SECRET)
    other = SecretBox(SecretStr(new_key()))
    with pytest.raises(UnsealError, match=r"the vault key for 2026-12 \(usd\) cannot be decrypted"):
        other.open(sealed, "the vault key for 2026-12 (usd)")
    altered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(UnsealError) as raised:
        SecretBox(SecretStr(new_key())).open(altered, "the key")
    assert "s3cr3t" not in str(raised.value)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("", "is empty"),
        (" , ", "is empty"),
        (f"{new_key()},not-a-key-but-a-secret", "key 2 of 2 is not a Fernet key"),
        ("A" * 43, "key 1 of 1 is not a Fernet key"),
    ],
    # Fixed ids: the random key must not name the test (parallel workers collect alike).
    ids=["empty", "blank", "second-not-a-key", "wrong-length"],
)
def test_bad_keys_are_refused_by_position_never_echoed(keys: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        SecretBox(SecretStr(keys))
    assert not shows_a_piece_of(keys, str(raised.value))
    # The same from the environment: the setting is named, its value never shown.
    with pytest.raises(ValidationError) as invalid:
        BillingSettings(billing_key_encryption_keys=SecretStr(keys))
    assert message in str(invalid.value)
    assert not shows_a_piece_of(keys, str(invalid.value))


def shows_a_piece_of(keys: str, text: str) -> bool:
    """Whether `text` holds six characters in a row of any of `keys`: not even a prefix of a
    key, good or bad, is shown."""
    parts = [part.strip() for part in keys.split(",")]
    return any(part[i : i + 6] in text for part in parts for i in range(len(part) - 5))


def test_a_worker_with_a_vault_needs_the_keys() -> None:
    with pytest.raises(ValidationError, match="BILLING_KEY_ENCRYPTION_KEYS is needed too"):
        BillingSettings(
            billing_vault_url="http://127.0.0.1:1",
            billing_vault_admin_token=SecretStr("admin-token-0123456789"),
        )
