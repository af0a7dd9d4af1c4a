"""Keep secrets, and forged lines, out of anything a person or a log can read."""

import re

# Stripe secret, restricted and publishable keys, and vault secrets (the vault refuses any
# request holding one). Glued to other text ("token=key_sk_test_...", an escaped
# "\\nsk_test_...", a path segment "X" + key), a key is known by its shape: its mode or the
# vault's prefix, then at least 16 characters, as every real key has; at a word's start,
# any length. So "task_queue", "is_sk_enabled", "network_live_status" or a placeholder
# "sk_test_..." are not keys; over-redacting a rarer look-alike is the cheaper mistake.
SECRET_RE = re.compile(
    # Stripe's masked form in its own messages ("The provided key 'rk_live_****Ab12' ..."):
    # its last characters are the key's.
    r"(?:sk|rk|pk)_(?:live|test)_\*+[A-Za-z0-9]*"
    r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"
    r"|vk_[A-Za-z0-9_-]{16,}"
    r"|(?<![A-Za-z0-9_])(?:(?:sk|rk|pk)_(?:live|test)_|vk_)[A-Za-z0-9][A-Za-z0-9_-]*"
)


def redact(text: str) -> str:
    """Replace anything shaped like a Stripe or vault key with a marker."""
    return SECRET_RE.sub("[redacted key]", text)


def one_line(text: str) -> str:
    """`text` with every unprintable character (a newline, a tab, a zero-width space) made a
    space: a reason or a name an operator typed is logged and shown as one line, and cannot
    forge another. One for one, so that a length checked before still holds: a run started
    before this rule rebuilds its requests from the text it holds."""
    return "".join(c if c.isprintable() else " " for c in text)


def shown_line(text: str) -> str:
    """Text a person typed or a service returned, as it may be shown or kept: no key, and
    one line."""
    return one_line(redact(text))


def shown_cut(text: str, limit: int, marker: str = "...") -> str:
    """`shown_line(text)`, cut to `limit` characters and `marker` when longer. Redacted before
    the cut, so that a cut key is still found whole."""
    text = shown_line(text)
    return text if len(text) <= limit else text[:limit] + marker
