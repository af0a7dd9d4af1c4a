"""SQL shared by the ledger's queries: which customers a period bills, which are held, and
the columns of a claim."""

from __future__ import annotations

from billing.reconciliation import INCOMPLETE_INTENT

# A row a cancelled run wrote for a customer it never started: nothing of it reached Stripe.
NEVER_STARTED = (
    "{r}.status = 'cancelled' AND {r}.cancelled_before_start AND {r}.charge_started_at IS NULL"
)


# The failure code of a claim whose lookup (does a charge with its key exist?) was refused
# for good: recorded failed so that its run can end, though a charge may exist.
LOOKUP_REFUSED = "lookup_refused"
# Failure codes of a claim recorded failed though a charge may exist: LOOKUP_REFUSED, and a
# PaymentIntent Stripe left unconfirmed, which it may yet complete until a person cancels it.
MAY_HAVE_CHARGED = (LOOKUP_REFUSED, INCOMPLETE_INTENT)
# A row `r` that charged its Stripe customer, or may have (failed under MAY_HAVE_CHARGED).
CHARGED = (
    f"({{r}}.status = 'charged' OR ({{r}}.status = 'failed' AND {{r}}.failure_code IN"
    f" ({', '.join(repr(code) for code in MAY_HAVE_CHARGED)})))"
)
# A row `r` that charged its Stripe customer (or may have), or holds a claim for it that is not
# skipped before its charge was sent (to be charged, or in doubt).
BILLED = (
    f"({CHARGED} OR ({{r}}.status = 'claimed'"
    " AND ({r}.skip_reason IS NULL OR {r}.charge_started_at IS NOT NULL)))"
)


# The customer id, inactive now, under which the period charged the Stripe customer of
# customer `c` (or may have), or holds a claim for it that is not skipped before its charge
# was sent (to be charged, or in doubt: a skip of a sent claim holds only if Stripe shows
# nothing then). An active customer with the same Stripe customer is most likely that one
# renamed (the old id deactivated, the new one imported), with a key of its own: it is held,
# not due, for as long as this holds (an old claim that fails releases it, unless a charge may
# exist all the same). An index of inactive customers by Stripe customer (migrations/017)
# makes it one probe per customer.
def held_as_sql(period: str = "$1", *, charged: bool = False) -> str:
    """The SQL of the above for customer `c`, the period being `period` (a parameter or a
    column); only rows that charged (or may have) count if `charged`."""
    billed = (CHARGED if charged else BILLED).format(r="o")
    return f"""(
    SELECT min(oc.customer_id) FROM customers oc
    JOIN billing_runs o ON o.customer_id = oc.customer_id AND o.billing_period = {period}
    WHERE NOT oc.active AND oc.stripe_customer_id = c.stripe_customer_id
        AND o.stripe_customer_id = c.stripe_customer_id AND oc.customer_id <> c.customer_id
        AND {billed})"""


HELD_AS = held_as_sql()


# Customers a period bills: active ones not held, and any with a row for it (a claim is
# always finished). A customer a cancelled run never started counts as having no row: billed
# only while active, at its amount, currency and card of now (its claim takes the row over so).
def due_join(past: str | None = None) -> str:
    """`past`, a cursor's parameter, joins only the period's rows after it: with the same
    bound on the customers (the caller's), a merge join starts at the cursor, not at the
    period's first row."""
    bound = f" AND r.customer_id > {past}" if past else ""
    return f"""
    FROM customers c
    LEFT JOIN billing_runs r ON r.customer_id = c.customer_id AND r.billing_period = $1
        AND NOT ({NEVER_STARTED.format(r="r")}){bound}
    """


DUE_WHERE = f"WHERE (r.status IS NOT NULL OR (c.active AND {HELD_AS} IS NULL))"
DUE = due_join() + DUE_WHERE

# Rows a run would charge: no row yet, or an unfinished claim not skipped.
OPEN = """(r.status IS NULL OR (r.status = 'claimed' AND r.skip_reason IS NULL))"""

CLAIM_COLUMNS = """
    customer_id, billing_period AS period, idempotency_key, amount_cents, currency,
    stripe_customer_id, payment_method, status, claimed_at, payment_intent_id, charge_id,
    failure_code, claimed_by_run, charge_api, now() - claimed_at AS claimed_ago
"""
