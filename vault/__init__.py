"""The vault proxy: Stripe behind per-period keys with a hard spend cap, an endpoint
allowlist, an expiry, a kill switch and an audit log.

It imports nothing itself: the workers and the command line use `vault.client` alone, and
the server (`vault.app`) would cost each of them a fifth of its start-up."""
