"""Keep secrets out of anything a person or a log can read."""

import re

# No leading word boundary: a key glued to other text ("token=key_sk_test_...", an escaped
# "\\nsk_test_...") is still a key. Over-redacting a look-alike is the cheaper mistake.
_SECRET_RE = re.compile(r"(sk|rk|pk)_(live|test)_[A-Za-z0-9]+|vk_[A-Za-z0-9_-]+")


def redact(text: str) -> str:
    """Replace anything shaped like a Stripe or vault key with a marker."""
    return _SECRET_RE.sub("[redacted key]", text)
