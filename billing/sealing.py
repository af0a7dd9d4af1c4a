"""Secrets the workers keep in the ledger database are sealed, so that whoever reads the
database or its backups (an operator's report, a replica) cannot charge with them.

Fernet (AES-128-CBC with HMAC-SHA256, from `cryptography`) under the keys of
BILLING_KEY_ENCRYPTION_KEYS, comma-separated and newest first: the first seals, any of them
opens. A worker seals every stored secret again with the first key when it starts. Workers
restart one at a time, so a key is rotated in three rollouts: the new one added last (each
worker opens what any seals), then put first, then the old one dropped. Put first at once,
the first worker restarted would reseal every secret with a key the others do not have.
"""

from __future__ import annotations

import binascii

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from pydantic import SecretStr

from billing.errors import BillingError

SETTING = "BILLING_KEY_ENCRYPTION_KEYS"


class UnsealError(BillingError):
    """A sealed secret could not be opened with the configured keys."""


def new_key() -> str:
    """A fresh key for BILLING_KEY_ENCRYPTION_KEYS."""
    return Fernet.generate_key().decode()


class SecretBox:
    def __init__(self, keys: SecretStr) -> None:
        parts = [part.strip() for part in keys.get_secret_value().split(",") if part.strip()]
        if not parts:
            raise ValueError(f"{SETTING} is empty: give at least one key")
        fernets = []
        for position, part in enumerate(parts, start=1):
            try:
                fernets.append(Fernet(part))
            except (ValueError, binascii.Error):
                # The value is a secret: say which one is wrong, never what it holds.
                raise ValueError(
                    f"{SETTING}: key {position} of {len(parts)} is not a Fernet key (32 bytes"
                    " in URL-safe base64, 44 characters); make one with"
                    " `python -m billing.sealing`"
                ) from None
        self._first = fernets[0]
        self._fernet = MultiFernet(fernets)

    def __repr__(self) -> str:
        return "SecretBox(...)"

    def seal(self, secret: SecretStr) -> bytes:
        return self._fernet.encrypt(secret.get_secret_value().encode())

    def reseal(self, sealed: bytes) -> bytes | None:
        """`sealed` as the first key seals it: itself if that key opens it, else sealed
        again with it; None if no key opens it."""
        try:
            self._first.decrypt(sealed)
            return sealed
        except InvalidToken:
            pass
        try:
            return self._fernet.rotate(sealed)
        except InvalidToken:
            return None

    def open(self, sealed: bytes, what: str) -> SecretStr:
        try:
            return SecretStr(self._fernet.decrypt(sealed).decode())
        except InvalidToken:
            raise UnsealError(
                f"{what} cannot be decrypted with {SETTING}: the key that sealed it is not"
                " among them (put the old key back after the new one), or the row was altered"
            ) from None


if __name__ == "__main__":
    print(new_key())
