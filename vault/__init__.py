"""The vault proxy: Stripe behind per-period keys with a hard spend cap, an endpoint
allowlist, an expiry, a kill switch and an audit log."""

from vault.app import RunningVault, create_app, serve
from vault.settings import VaultSettings

__all__ = ["RunningVault", "VaultSettings", "create_app", "serve"]
