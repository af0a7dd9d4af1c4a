"""In-memory state: one table per resource, indexed by id, creation order and customer."""

from __future__ import annotations

import bisect
import itertools
import random
import time
from typing import Any, Generic, Protocol, TypeVar

from .errors import JSON, no_such
from .models import Charge, Customer, PaymentIntent, PaymentMethod, Refund

APIObject = Customer | PaymentMethod | PaymentIntent | Charge | Refund


class Record(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def seq(self) -> int: ...

    def to_api(self) -> JSON: ...


R = TypeVar("R", bound=Record)


def seq_of(record: Record) -> int:
    return record.seq


class Table(Generic[R]):
    """Records by id, plus lists sorted by creation (``seq``) for cursor pagination."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.by_id: dict[str, R] = {}
        self.order: list[R] = []
        self.by_customer: dict[str, list[R]] = {}

    def add(self, record: R) -> None:
        self.by_id[record.id] = record
        self.order.append(record)

    def index_customer(self, record: R, customer: str) -> None:
        # insort rather than append: a payment method created earlier can be attached later.
        bisect.insort(self.by_customer.setdefault(customer, []), record, key=seq_of)

    def get(self, object_id: str, *, param: str = "id", status: int = 404) -> R:
        record = self.by_id.get(object_id)
        if record is None:
            raise no_such(self.kind, object_id, param=param, status=status)
        return record

    def page(
        self,
        records: list[R],
        limit: int,
        starting_after: str | None,
        ending_before: str | None,
    ) -> tuple[list[R], bool]:
        """Newest first, like Stripe: ``starting_after`` pages to older records."""
        if ending_before is not None:
            cursor = self.get(ending_before, param="ending_before", status=400).seq
            low = bisect.bisect_right(records, cursor, key=seq_of)
            high = min(low + limit, len(records))
            return records[low:high][::-1], high < len(records)
        high = len(records)
        if starting_after is not None:
            cursor = self.get(starting_after, param="starting_after", status=400).seq
            high = bisect.bisect_left(records, cursor, key=seq_of)
        low = max(high - limit, 0)
        return records[low:high][::-1], low > 0


class Store:
    def __init__(self) -> None:
        self.customers: Table[Customer] = Table("customer")
        self.payment_methods: Table[PaymentMethod] = Table("PaymentMethod")
        self.payment_intents: Table[PaymentIntent] = Table("payment_intent")
        self.charges: Table[Charge] = Table("charge")
        self.refunds: Table[Refund] = Table("refund")
        self._by_prefix: dict[str, Table[Any]] = {
            "cus": self.customers,
            "pm": self.payment_methods,
            # A customer's legacy card source, usable wherever a payment method is.
            "card": self.payment_methods,
            "pi": self.payment_intents,
            "ch": self.charges,
            "py": self.charges,
            "re": self.refunds,
        }
        self._seq = itertools.count()
        # Not the seeded fault generator: ids must differ across resets and runs, draws must not.
        self._ids = random.Random()

    def identity(self, prefix: str) -> tuple[str, int, int]:
        """A new object's ``(id, seq, created)``, the first three fields of every model."""
        return f"{prefix}_{self._ids.getrandbits(96):024x}", next(self._seq), int(time.time())

    def find(self, object_id: str) -> APIObject | None:
        table = self._by_prefix.get(object_id.partition("_")[0])
        found: APIObject | None = None if table is None else table.by_id.get(object_id)
        return found
