"""Chaos runs: a period billed while its worker, database and Stripe fail (scenario), and the
invariants checked afterwards from Stripe's ledger, Postgres and the vault (invariants)."""
