"""Customers due for billing: CSV import (all rows valid or nothing imported) and upserts."""

from __future__ import annotations

import codecs
import csv
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import asyncpg
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from billing.errors import (
    CustomerImportError,
    InvalidInputError,
    UnknownCustomerError,
    shown,
)
from billing.keys import validate_customer_id
from billing.ledger import NEVER_STARTED, held_as_sql, lock_for_change
from billing.ledger.sql import BILLED
from billing.models import Record
from billing.money import (
    describe_amount,
    parse_amount,
    validate_amount,
    validate_amount_in,
    validate_currency,
)
from billing.redact import SECRET_RE
from billing.wording import counted, listed

CSV_COLUMNS = ("customer_id", "stripe_customer_id", "payment_method", "amount_cents", "currency")
# How many bad rows an import's refusal lists: the rest are counted.
BAD_ROWS_SHOWN = 20
_STRIPE_CUSTOMER_RE = re.compile(r"cus_[A-Za-z0-9]{1,250}")
_PAYMENT_METHOD_RE = re.compile(r"pm_[A-Za-z0-9_]{1,250}")


class CustomerRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    customer_id: str
    stripe_customer_id: str
    # Named, always: with none, a PaymentIntent takes the Stripe customer's `default_source`
    # (a legacy card), not its invoice default, and most customers have none.
    payment_method: str
    amount_cents: int
    currency: str

    @field_validator("customer_id")
    @classmethod
    def _customer_id(cls, value: str) -> str:
        return validate_customer_id(value)

    @field_validator("stripe_customer_id")
    @classmethod
    def _stripe_customer(cls, value: str) -> str:
        if not _STRIPE_CUSTOMER_RE.fullmatch(value):
            raise InvalidInputError(
                f"stripe_customer_id {shown(value, 60)} is not a Stripe id cus_..."
            )
        return value

    @field_validator("payment_method")
    @classmethod
    def _payment_method(cls, value: str) -> str:
        if not value:
            raise InvalidInputError(
                "payment_method is empty: name the payment method to charge (pm_...); Stripe"
                " charges a customer's invoice default only if it is named"
            )
        if not _PAYMENT_METHOD_RE.fullmatch(value):
            raise InvalidInputError(f"payment_method {shown(value, 60)} is not a Stripe id pm_...")
        if SECRET_RE.search(value):
            # The vault refuses any request carrying a key: no charge of this row could pass.
            raise InvalidInputError(
                "payment_method must not contain what looks like a Stripe or vault key"
                " (sk_live_..., rk_test_..., vk_...)"
            )
        return value

    @field_validator("amount_cents")
    @classmethod
    def _amount(cls, value: int) -> int:
        return validate_amount(value)

    @field_validator("currency")
    @classmethod
    def _currency(cls, value: str) -> str:
        return validate_currency(value)

    @model_validator(mode="after")
    def _amount_in_currency(self) -> CustomerRow:
        validate_amount_in(self.amount_cents, self.currency)
        return self


def _row_from_csv(fields: dict[str, str | None]) -> CustomerRow:
    def text(name: str) -> str:
        value = fields.get(name)
        if value is None or not value.strip():
            raise InvalidInputError(f"{name} is empty")
        return value.strip()

    return CustomerRow(
        customer_id=text("customer_id"),
        stripe_customer_id=text("stripe_customer_id"),
        # Checked in the model, after the columns before it, like them.
        payment_method=(fields.get("payment_method") or "").strip(),
        amount_cents=parse_amount(text("amount_cents")),
        currency=text("currency"),
    )


def parse_customers_csv(lines: Iterable[str], source: str = "input") -> list[CustomerRow]:
    """Validate every row; a bad one rejects the whole file, which names each by its line."""
    blank: set[int] = set()

    def numbered() -> Iterator[str]:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                blank.add(number)
            yield line

    # Strict: a quote left open would otherwise take the rest of the file into one field.
    reader = csv.DictReader(numbered(), restkey="_extra", strict=True)
    try:
        return _parse_rows(reader, source, blank)
    except csv.Error as exc:  # in the header
        raise CustomerImportError(f"{source}, {_unsplit(reader, exc, blank)}") from None


def _unsplit(reader: csv.DictReader[str], exc: csv.Error, blank: set[int]) -> str:
    """Where and why the csv module cannot split a line (e.g. a field over its limit)."""
    if _runs_to_the_end(exc):
        # The row began on the first line after the last one read whole that is not
        # blank (the reader skips blank lines between rows).
        began = reader.line_num + 1
        while began in blank:
            began += 1
        return (
            f'line {began}: a quote (") opened on this line or the next ones is never closed:'
            " the field runs to the end of the file"
        )
    # The inner reader's count: DictReader updates its own only after a row parses.
    return f"line {reader.reader.line_num}: {exc}"


def _runs_to_the_end(exc: csv.Error) -> bool:
    return str(exc) == "unexpected end of data"


class _BadRows:
    """The file's bad rows: every one counted, the first BAD_ROWS_SHOWN kept to be shown."""

    def __init__(self, source: str) -> None:
        self._source = source
        self._shown: list[str] = []
        self._count = 0

    def add(self, problem: str) -> None:
        self._count += 1
        if len(self._shown) < BAD_ROWS_SHOWN:
            self._shown.append(f"{self._source}, {problem}")

    def refuse(self) -> None:
        """Refuse the file if it has a bad row: every one at once, so that a file of many is
        mended in one round, not one per row."""
        if self._count == 1:
            raise CustomerImportError(self._shown[0])
        if self._count:
            more = self._count - len(self._shown)
            listed_rows = self._shown + ([f"and {counted(more, 'more bad row')}"] if more else [])
            raise CustomerImportError(
                f"{self._source} has {self._count} rows the import cannot take; nothing was"
                " imported:\n  " + "\n  ".join(listed_rows)
            )


def _parse_rows(reader: csv.DictReader[str], source: str, blank: set[int]) -> list[CustomerRow]:
    # Values are read stripped, so are the names: "customer_id, amount_cents" is no typo.
    fieldnames = reader.fieldnames
    if not fieldnames:
        # The csv module reads a blank first line as a header of no names: is more to come?
        more = fieldnames is not None and any(any(map(str.strip, r)) for r in reader.reader)
        what = "starts with a blank line" if more else "is empty"
        raise CustomerImportError(
            f"{source} {what}: its first line must be a header naming"
            f" {', '.join(CSV_COLUMNS)}, then a row per customer"
        )
    header = [name.strip() for name in fieldnames]
    reader.fieldnames = header
    # DictReader keeps the last of two same-named columns: which one the file meant is a guess.
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        names = listed([shown(name) for name in twice])
        raise CustomerImportError(f"{source}: header names {names} more than once")
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        separator = next((s for s in (";", "\t", "|") if len(header) == 1 and s in header[0]), None)
        hint = f" (the columns look separated by {separator!r}: separate them with commas)"
        raise CustomerImportError(
            f"{source}: header must name the columns {', '.join(CSV_COLUMNS)};"
            f" missing {', '.join(missing)}{hint if separator else ''}"
        )
    # A column this import does not know (e.g. "active") would be dropped without a word,
    # while the operator counts on it.
    unknown = [shown(n) if n else "an unnamed column" for n in header if n not in CSV_COLUMNS]
    if unknown:
        raise CustomerImportError(
            f"{source}: header names {listed(unknown)}, which the import does not read: it"
            f" takes only {', '.join(CSV_COLUMNS)} (and makes each customer active); remove"
            " the other columns"
        )
    rows: list[CustomerRow] = []
    bad = _BadRows(source)
    seen: dict[str, int] = {}
    spellings: dict[tuple[str, str], tuple[str, int]] = {}
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            # The strict reader goes on at the next line; a quote left open ends the file.
            bad.add(_unsplit(reader, exc, blank))
            if _runs_to_the_end(exc):
                break
            continue
        line = reader.line_num
        try:
            row = _checked_row(fields, len(header))
            if row is None:
                continue
            if row.customer_id in seen:
                raise InvalidInputError(
                    f"customer {row.customer_id!r} already appears on line {seen[row.customer_id]}"
                )
            spelt = spellings.get(_spelling(row))
            if spelt is not None:
                raise InvalidInputError(
                    f"customer {row.customer_id!r} is {spelt[0]!r} (line {spelt[1]}) spelt"
                    " another way, with the same Stripe customer: both would be charged each"
                    " period; keep one of them"
                )
        except (InvalidInputError, ValueError) as exc:
            bad.add(f"line {line}: {_reason(exc)}")
            # Its id taken all the same: a second row of it is told now, not once this is mended.
            given = (fields.get("customer_id") or "").strip()
            if given:
                seen.setdefault(given, line)
            continue
        seen[row.customer_id] = line
        spellings[_spelling(row)] = (row.customer_id, line)
        rows.append(row)
    bad.refuse()
    if not rows:
        raise CustomerImportError(f"{source}: no customer rows after the header")
    return rows


def _checked_row(fields: dict[str, str | None], columns: int) -> CustomerRow | None:
    """The row's customer; None for a row of spaces only."""
    if fields.get("_extra"):
        raise InvalidInputError("more fields than the header names")
    if not any(value and value.strip() for value in fields.values()):
        # Spaces only: blank to whoever reads the file, as the blank lines it skips.
        return None
    given = sum(value is not None for value in fields.values())
    if given < columns:
        raise InvalidInputError(f"{given} fields where the header names {columns}")
    return _row_from_csv(fields)


def _spelling(row: CustomerRow) -> tuple[str, str]:
    """Ids that differ only in case may be two customers, but not with one Stripe customer:
    then they are one customer imported twice, each id with its own key and charge."""
    return row.customer_id.lower(), row.stripe_customer_id


def read_customers_csv(path: Path) -> list[CustomerRow]:
    try:
        # utf-8-sig: spreadsheets often save CSV with a byte-order mark before the header.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return parse_customers_csv(handle, source=str(path))
    except OSError as exc:
        raise CustomerImportError(f"cannot read {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CustomerImportError(
            f"cannot read {path}: it is not UTF-8 ({_not_utf8(path, exc)}); save it as UTF-8"
            " (CSV UTF-8 in a spreadsheet's Save As)"
        ) from None


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> str:
    """Where in the file it stops being UTF-8: the reader's error counts from the chunk it
    was decoding, and from after a byte-order mark."""
    data = path.read_bytes()
    mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        data[mark:].decode("utf-8")
    except UnicodeDecodeError as whole:
        at = mark + whole.start
        line = data[:at].count(b"\n") + 1
        return f"{whole.reason} at byte {at}, line {line}"
    return exc.reason


def _reason(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        # pydantic wraps our validators' errors; show the field and our message only.
        first = errors()[0]
        field = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("ctx", {}).get("error", first.get("msg", "")))
        return f"{field}: {message}" if field else message
    return str(exc)


async def import_customers(
    pool: asyncpg.Pool, rows: Sequence[CustomerRow], *, while_running: bool, reactivate: bool
) -> list[RunningChange]:
    """Write the rows, unless they change what an open run has yet to charge (see
    changes_to_open_runs) and not `while_running`: those changes are returned either way,
    and then nothing is written. Deactivated customers among them are refused unless
    `reactivate`. Checked and written as one step to a run's opening (ledger.open_period),
    which waits for it, or which it waits for (ledger.lock_for_change: at most
    CHANGE_WAIT_SECONDS)."""
    async with pool.acquire() as conn, conn.transaction():
        await lock_for_change(conn, "the import")
        await _refuse_respelt(conn, rows)
        await _refuse_renames_undone(conn, rows)
        if not reactivate:
            await _refuse_reactivated(conn, rows)
        changes = await changes_to_open_runs(conn, rows)
        if while_running or not changes:
            await _write(conn, rows)
    return changes


async def _refuse_respelt(conn: asyncpg.Connection, rows: Sequence[CustomerRow]) -> None:
    """Refuse new ids that are an active customer's spelt another way (see _spelling)."""
    found = await conn.fetch(
        """
        SELECT n.customer_id AS new_id, c.customer_id AS existing_id, c.stripe_customer_id
        FROM unnest($1::text[], $2::text[]) AS n(customer_id, stripe_customer_id)
        JOIN customers c ON lower(c.customer_id) = lower(n.customer_id)
            AND c.customer_id <> n.customer_id AND c.active
            AND c.stripe_customer_id = n.stripe_customer_id
        ORDER BY n.customer_id
        """,
        [r.customer_id for r in rows],
        [r.stripe_customer_id for r in rows],
    )
    if found:
        shown = listed(
            [f"{r['new_id']!r} for {r['existing_id']!r} ({r['stripe_customer_id']})" for r in found]
        )
        raise CustomerImportError(
            f"{len({r['new_id'] for r in found})} customer ids are those of active customers"
            f" spelt another way, with the same Stripe customer: {shown}."
            " Imported, each would be charged twice a"
            " period, once per id. Use the ids already imported; nothing was imported"
        )


# Periods billed this recently may be run again (a rerun bills customers added since).
RERUN_WINDOW = timedelta(days=62)


async def _refuse_renames_undone(conn: asyncpg.Connection, rows: Sequence[CustomerRow]) -> None:
    """Refuse to write an inactive id (the import makes it active) while a Stripe customer it
    has, had in a billed row, or is given has another active id (in the ledger or in the
    import), or was billed under another id in a period that may still run (RERUN_WINDOW)
    where this one has no row: most likely a rename undone (a master file imported whole,
    say), which releases the new id's hold (ledger.sql.HELD_AS, which reads the old id's
    Stripe customer as it is now), or makes the old id due in a period the new id charged:
    the Stripe customer charged twice in it."""
    found = await conn.fetch(
        f"""
        WITH n(customer_id, stripe_customer_id) AS (SELECT * FROM unnest($1::text[], $2::text[])),
        old(customer_id, stripe_customer_id) AS (
            SELECT n.customer_id, n.stripe_customer_id FROM n
            JOIN customers c ON c.customer_id = n.customer_id AND NOT c.active
            UNION SELECT c.customer_id, c.stripe_customer_id FROM customers c
            WHERE c.customer_id = ANY($1::text[]) AND NOT c.active
            UNION SELECT r.customer_id, r.stripe_customer_id FROM billing_runs r
            JOIN customers c ON c.customer_id = r.customer_id AND NOT c.active
            WHERE r.customer_id = ANY($1::text[]) AND {BILLED.format(r="r")}),
        others(customer_id, stripe_customer_id, billing_period) AS (
            SELECT customer_id, stripe_customer_id, NULL FROM customers
            WHERE active AND customer_id <> ALL($1::text[])
            UNION SELECT customer_id, stripe_customer_id, NULL FROM n
            UNION SELECT r.customer_id, r.stripe_customer_id, r.billing_period
            FROM billing_runs r JOIN billing_periods p USING (billing_period)
            WHERE {BILLED.format(r="r")}
                AND (p.state = 'running' OR p.started_at > now() - $3::interval))
        SELECT old.customer_id AS old_id,
               array_agg(DISTINCT o.stripe_customer_id ORDER BY o.stripe_customer_id)
                   AS stripe_ids,
               array_agg(DISTINCT o.customer_id ORDER BY o.customer_id) AS other_ids
        FROM old JOIN others o ON o.stripe_customer_id = old.stripe_customer_id
            AND o.customer_id <> old.customer_id
            -- Billed in a period: only where this id has no row of its own, to be billed.
            AND (o.billing_period IS NULL OR NOT EXISTS (
                SELECT 1 FROM billing_runs mine WHERE mine.customer_id = old.customer_id
                    AND mine.billing_period = o.billing_period))
        GROUP BY old.customer_id
        ORDER BY old.customer_id
        """,
        [r.customer_id for r in rows],
        [r.stripe_customer_id for r in rows],
        RERUN_WINDOW,
    )
    if found:
        shown = listed(
            [
                f"{r['old_id']!r} ({', '.join(r['stripe_ids'])},"
                f" also {', '.join(r['other_ids'])}'s)"
                for r in found
            ]
        )
        raise CustomerImportError(
            f"{_ids(len(found))} would be made active again while a Stripe customer of theirs"
            f" is another id's, or was billed as one lately: {shown}. Most likely renamed"
            " since: made active, a Stripe customer would be charged under both ids, twice in"
            " a period. Leave them out of the file, or make sure the other id is not that"
            " customer; nothing was imported"
        )


async def _refuse_reactivated(conn: asyncpg.Connection, rows: Sequence[CustomerRow]) -> None:
    """Refuse to make deactivated customers active again unasked: a file exported before they
    left (or a master file imported whole) would bill customers who have gone."""
    found = await conn.fetch(
        "SELECT customer_id FROM customers WHERE customer_id = ANY($1::text[]) AND NOT active"
        " ORDER BY customer_id",
        [r.customer_id for r in rows],
    )
    if found:
        raise CustomerImportError(
            f"{_ids(len(found))} would be made active again and billed from the next run on:"
            f" {listed([r['customer_id'] for r in found])}. If they are back, import with"
            " --reactivate; if the file predates their deactivation, leave them out of it;"
            " nothing was imported"
        )


def _ids(count: int) -> str:
    return "1 inactive customer id" if count == 1 else f"{count} inactive customer ids"


async def sharing_a_stripe_customer(
    pool: asyncpg.Pool, customer_ids: Sequence[str]
) -> dict[str, list[str]]:
    """The Stripe customers that any of these customers shares with another active id,
    with all their active ids: each id is charged every period (preview warns of it too)."""
    rows = await pool.fetch(
        """
        SELECT stripe_customer_id, array_agg(customer_id ORDER BY customer_id) AS ids
        FROM customers
        WHERE active AND stripe_customer_id IN (
            SELECT stripe_customer_id FROM customers
            WHERE active AND customer_id = ANY($1::text[]))
        GROUP BY stripe_customer_id HAVING count(*) > 1
        ORDER BY stripe_customer_id
        """,
        list(customer_ids),
    )
    return {r["stripe_customer_id"]: list(r["ids"]) for r in rows}


async def upsert_customers(pool: asyncpg.Pool, rows: Sequence[CustomerRow]) -> int:
    """Insert or update the rows in one transaction, whatever runs (demo and test seeding);
    returns how many were written."""
    async with pool.acquire() as conn, conn.transaction():
        await _write(conn, rows)
    return len(rows)


# Rows written by one statement: a call may take 30 s (db.create_pool), and 300,000 rows in
# one took 16-26 s on a loaded two-CPU machine, so a file of half a million timed out.
WRITE_CHUNK = 20_000


async def _write(conn: asyncpg.Connection, rows: Sequence[CustomerRow]) -> None:
    """Insert or update the rows (the last of an id wins), a chunk of them per statement
    over arrays, in the caller's transaction."""
    unique = list({r.customer_id: r for r in rows}.values())
    for start in range(0, len(unique), WRITE_CHUNK):
        await _write_chunk(conn, unique[start : start + WRITE_CHUNK])


async def _write_chunk(conn: asyncpg.Connection, rows: Sequence[CustomerRow]) -> None:
    await conn.execute(
        """
        INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,
                               currency)
        SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[])
        ON CONFLICT (customer_id) DO UPDATE SET
            stripe_customer_id = EXCLUDED.stripe_customer_id,
            payment_method = EXCLUDED.payment_method,
            amount_cents = EXCLUDED.amount_cents,
            currency = EXCLUDED.currency,
            active = true,
            updated_at = now()
        """,
        [r.customer_id for r in rows],
        [r.stripe_customer_id for r in rows],
        [r.payment_method for r in rows],
        [r.amount_cents for r in rows],
        [r.currency for r in rows],
    )


class RunningChange(Record):
    """An import changing what an open period run has yet to charge a customer."""

    period: str
    customer_id: str
    was: str
    becomes: str


async def changes_to_open_runs(
    conn: asyncpg.Connection, rows: Sequence[CustomerRow]
) -> list[RunningChange]:
    """Customers the rows add, make active again, or reprice while a period's run has not yet
    claimed them: that run may bill them, at a price its plan and its vault key's cap did not
    count (a new currency, with no key in that period, pauses it), and bill some customers at
    the old price and these at the new. And those repriced whose claim is open but not yet
    sent: the claim keeps the price it was made with (every request with its key carries the
    same), so the run charges the old one, which the operator is told."""
    found = await conn.fetch(
        f"""
        SELECT p.billing_period, n.customer_id, c.active, c.amount_cents, c.currency,
               n.amount_cents AS new_amount, n.currency AS new_currency,
               r.status = 'claimed' AS claimed, r.amount_cents AS claimed_amount,
               r.currency AS claimed_currency, n.stripe_customer_id,
               -- Another active id the run billed this Stripe customer as: this one may be
               -- that one renamed before it was deactivated, which the run would charge again.
               (SELECT min(o.customer_id) FROM billing_runs o
                JOIN customers oc ON oc.customer_id = o.customer_id AND oc.active
                WHERE o.billing_period = p.billing_period
                    AND o.stripe_customer_id = n.stripe_customer_id
                    AND o.customer_id <> n.customer_id
                    AND o.status IN ('charged', 'claimed')) AS billed_as
        FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[])
            AS n(customer_id, amount_cents, currency, stripe_customer_id)
        LEFT JOIN customers c ON c.customer_id = n.customer_id
        JOIN billing_periods p ON p.state = 'running'
        LEFT JOIN billing_runs r
            ON r.customer_id = n.customer_id AND r.billing_period = p.billing_period
        WHERE ((c.customer_id IS NULL OR NOT c.active
                OR (c.amount_cents, c.currency) <> (n.amount_cents, n.currency))
               AND (r.status IS NULL OR ({NEVER_STARTED.format(r="r")})))
           OR (r.status = 'claimed' AND r.charge_started_at IS NULL AND r.skip_reason IS NULL
               AND (c.amount_cents, c.currency) <> (n.amount_cents, n.currency)
               AND (r.amount_cents, r.currency) <> (n.amount_cents, n.currency))
        ORDER BY p.billing_period, n.customer_id
        """,
        [r.customer_id for r in rows],
        [r.amount_cents for r in rows],
        [r.currency for r in rows],
        [r.stripe_customer_id for r in rows],
    )
    return [
        RunningChange(
            period=row["billing_period"],
            customer_id=row["customer_id"],
            was=_was(row),
            becomes=(
                f"{describe_amount(row['new_currency'], row['new_amount'])} from the next period"
                if row["claimed"]
                else describe_amount(row["new_currency"], row["new_amount"])
            ),
        )
        for row in found
    ]


def _was(row: asyncpg.Record) -> str:
    if row["claimed"]:
        claimed = describe_amount(row["claimed_currency"], row["claimed_amount"])
        return f"claimed at {claimed}, which the run charges unless skipped"
    if row["active"] is None:
        was = "new"
    else:
        price = describe_amount(row["currency"], row["amount_cents"])
        was = price if row["active"] else f"inactive, {price}"
    if row["billed_as"] is not None:
        was += (
            f", on {row['stripe_customer_id']}, which this run billed as {row['billed_as']}"
            f" (if renamed, deactivate {row['billed_as']} first)"
        )
    return was


class Billable(Record):
    """A customer a period may still charge: `claimed`, an open claim not yet sent, which a
    run charges whether or not the customer is active (a skip stops it); else one an open
    run has yet to claim."""

    period: str
    customer_id: str
    claimed: bool


class Held(Record):
    """An active customer an open run would hold once `held_as` is inactive: it shares its
    Stripe customer, which the run billed under `held_as`, so is taken for it renamed."""

    period: str
    customer_id: str
    held_as: str


class Deactivation(Record):
    """What `deactivate_customers` did: nothing when `still_billable` or `would_hold` is
    refused."""

    deactivated: list[str]
    already_inactive: list[str]
    still_billable: list[Billable]
    would_hold: list[Held] = []


async def deactivate_customers(
    pool: asyncpg.Pool, customer_ids: Sequence[str], *, while_running: bool
) -> Deactivation:
    """Make customers inactive: no run opened from now on lists them, and their rows of past
    periods stay. An unknown id refuses them all. So does a customer a period may still
    charge (`Billable`), unless `while_running`: an open claim is charged all the same (a
    skip stops it), and a run that has yet to claim a customer does not charge it, but
    reports failed (unknown_customer) one whose child it has started. One step to a run's
    opening, as an import is (ledger.open_period)."""
    ids = sorted({validate_customer_id(c) for c in customer_ids})
    async with pool.acquire() as conn, conn.transaction():
        await lock_for_change(conn, "the deactivation")
        found = await conn.fetch(
            "SELECT customer_id, active FROM customers WHERE customer_id = ANY($1::text[])", ids
        )
        if unknown := sorted(set(ids) - {row["customer_id"] for row in found}):
            raise UnknownCustomerError(
                f"no customer {listed(list(map(repr, unknown)))} in the ledger;"
                " nothing was deactivated"
            )
        inactive = sorted(row["customer_id"] for row in found if not row["active"])
        active = sorted(row["customer_id"] for row in found if row["active"])
        billable = await _still_billable(conn, active)
        would_hold = await _would_hold(conn, active)
        if (billable or would_hold) and not while_running:
            return Deactivation(
                deactivated=[],
                already_inactive=inactive,
                still_billable=billable,
                would_hold=would_hold,
            )
        await conn.execute(
            "UPDATE customers SET active = false, updated_at = now()"
            " WHERE customer_id = ANY($1::text[])",
            active,
        )
    return Deactivation(
        deactivated=active,
        already_inactive=inactive,
        still_billable=billable,
        would_hold=would_hold,
    )


async def _would_hold(conn: asyncpg.Connection, customer_ids: Sequence[str]) -> list[Held]:
    """The active customers an open run has yet to bill that it would hold once these are
    inactive (ledger.sql.HELD_AS): another account on the same Stripe customer, which a
    deactivation after its charge would leave unbilled for that period without a word."""
    rows = await conn.fetch(
        f"""
        SELECT DISTINCT p.billing_period, c.customer_id, o.customer_id AS held_as
        FROM billing_periods p
        JOIN billing_runs o ON o.billing_period = p.billing_period
            AND o.customer_id = ANY($1::text[]) AND {BILLED.format(r="o")}
        JOIN customers oc ON oc.customer_id = o.customer_id
            AND oc.stripe_customer_id = o.stripe_customer_id
        JOIN customers c ON c.stripe_customer_id = o.stripe_customer_id AND c.active
            AND c.customer_id <> ALL($1::text[])
        LEFT JOIN billing_runs r ON r.customer_id = c.customer_id
            AND r.billing_period = p.billing_period AND NOT ({NEVER_STARTED.format(r="r")})
        WHERE p.state = 'running' AND r.status IS NULL
        ORDER BY 1, 2
        """,
        list(customer_ids),
    )
    return [
        Held(period=r["billing_period"], customer_id=r["customer_id"], held_as=r["held_as"])
        for r in rows
    ]


async def _still_billable(conn: asyncpg.Connection, customer_ids: Sequence[str]) -> list[Billable]:
    rows = await conn.fetch(
        f"""
        SELECT r.billing_period, r.customer_id, true AS claimed FROM billing_runs r
        WHERE r.customer_id = ANY($1::text[]) AND r.status = 'claimed' AND r.skip_reason IS NULL
            -- One already sent ends as Stripe answers: nothing done now changes it.
            AND r.charge_started_at IS NULL
        UNION ALL
        SELECT p.billing_period, c.customer_id, false FROM customers c
        JOIN billing_periods p ON p.state = 'running'
        LEFT JOIN billing_runs r
            ON r.customer_id = c.customer_id AND r.billing_period = p.billing_period
        WHERE c.customer_id = ANY($1::text[])
            AND (r.status IS NULL OR ({NEVER_STARTED.format(r="r")}))
            -- A held customer is one the run would not bill anyway.
            AND {held_as_sql("p.billing_period")} IS NULL
        ORDER BY 1, 2
        """,
        list(customer_ids),
    )
    return [
        Billable(
            period=row["billing_period"], customer_id=row["customer_id"], claimed=row["claimed"]
        )
        for row in rows
    ]
