"""The local stack: Temporal dev server, PostgreSQL, the Stripe emulator and a worker."""
