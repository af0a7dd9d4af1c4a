"""Keep secrets out of anything a person or a log can read."""

import re

# Stripe secret, restricted and publishable keys, and vault secrets (the vault refuses any
# request holding one). No leading word boundary for a key with its mode or the vault's
# prefix: glued to other text ("token=key_sk_test_...", an escaped "\\nsk_test_...", a path
# segment "X" + key) it is still a key. A bare "sk_" or "rk_" counts at a word's start only,
# so "task_queue" is not one. Over-redacting a look-alike is the cheaper mistake.
SECRET_RE = re.compile(
    r"(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9_-]+"
    r"|vk_[A-Za-z0-9_-]+"
    r"|(?<![A-Za-z0-9])(?:sk|rk)_[A-Za-z0-9_-]+"
)


def redact(text: str) -> str:
    """Replace anything shaped like a Stripe or vault key with a marker."""
    return SECRET_RE.sub("[redacted key]", text)
