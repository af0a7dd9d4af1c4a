"""Tests of the Stripe emulator (a package so modules can share .support)."""
