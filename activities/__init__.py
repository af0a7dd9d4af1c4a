"""Activities: every piece of I/O the workflows do (Postgres, Stripe through the vault)."""
