"""The shop behind the `workflow` environment: generated data, its SQLite database, the tools.

`generate_shop(seed)` builds a small shop as plain rows, deterministically from `seed`:
6-10 customers with 1-4 orders each, every order on its own day (ids rise with the date,
so "most recent" is never a tie), and a shipment for each shipped or delivered order.
`open_db(shop)` loads it into a fresh in-memory SQLite database: nothing touches the disk,
and every episode has its own. `TOOL_FUNCTIONS` run one API call against that database and
return JSON-able data, or `{"error": ...}` for a bad request, as a real API would.
`snapshot(db)` reads the state that rewards compare: order statuses and addresses.
"""

from __future__ import annotations

import datetime
import random
import sqlite3
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

ORDER_STATUSES = ("placed", "shipped", "delivered", "refunded")
UNDELIVERED = ("placed", "shipped")
FIRST_ORDER_ID = 101  # order ids never look like customer ids (1-10)

_FIRST = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kim", "Leo")
_LAST = ("Lee", "Khan", "Moss", "Ngata", "Okafor", "Park", "Quinn", "Reyes", "Silva", "Todd")
_STREETS = ("Oak", "Elm", "Mill", "High", "Park", "Lake", "Hill", "Rose", "Bridge", "Church")
_CITIES = ("Leeds", "York", "Bath", "Derby", "Exeter", "Truro", "Ely", "Hull")
_CARRIERS = ("UPS", "DHL", "FedEx")
_FIRST_DAY = datetime.date(2024, 1, 1)

_SCHEMA = """
CREATE TABLE customers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL UNIQUE,
    address TEXT NOT NULL);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
    placed_at TEXT NOT NULL, total REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('placed', 'shipped', 'delivered', 'refunded')));
CREATE TABLE shipments (
    order_id INTEGER PRIMARY KEY REFERENCES orders(id), carrier TEXT NOT NULL,
    status TEXT NOT NULL, updated_at TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Customer:
    id: int
    name: str
    email: str
    address: str


@dataclass(frozen=True)
class Order:
    id: int
    customer_id: int
    placed_at: str  # ISO date
    total: float
    status: str


@dataclass(frozen=True)
class Shipment:
    order_id: int
    carrier: str
    status: str  # in_transit | delivered
    updated_at: str


@dataclass(frozen=True)
class Shop:
    customers: list[Customer]
    orders: list[Order]  # oldest first
    shipments: list[Shipment]

    def customer_by_email(self, email: str) -> Customer | None:
        return next((c for c in self.customers if c.email == email), None)

    def orders_of(self, customer_id: int) -> list[Order]:
        return [o for o in self.orders if o.customer_id == customer_id]


def random_address(rng: random.Random) -> str:
    return f"{rng.randint(1, 99)} {rng.choice(_STREETS)} St, {rng.choice(_CITIES)}"


def _day(offset: int) -> str:
    return (_FIRST_DAY + datetime.timedelta(days=offset)).isoformat()


def generate_shop(seed: int) -> Shop:
    """A small shop, the same for the same seed."""
    rng = random.Random(seed)
    names = rng.sample([f"{f} {s}" for f in _FIRST for s in _LAST], rng.randint(6, 10))
    customers = [
        Customer(i + 1, name, name.lower().replace(" ", ".") + "@example.com", random_address(rng))
        for i, name in enumerate(names)
    ]
    owners = [c.id for c in customers for _ in range(rng.randint(1, 4))]
    rng.shuffle(owners)
    days = sorted(rng.sample(range(120), len(owners)))  # distinct days: no ties in recency
    orders, shipments = [], []
    for i, (owner, day) in enumerate(zip(owners, days)):
        status = rng.choices(ORDER_STATUSES, weights=(3, 3, 4, 1))[0]
        order = Order(FIRST_ORDER_ID + i, owner, _day(day), round(rng.uniform(5, 300), 2), status)
        orders.append(order)
        if status in ("shipped", "delivered"):
            shipped = "in_transit" if status == "shipped" else "delivered"
            updated = _day(day + rng.randint(1, 5))
            shipments.append(Shipment(order.id, rng.choice(_CARRIERS), shipped, updated))
    return Shop(customers, orders, shipments)


def open_db(shop: Shop) -> sqlite3.Connection:
    """A fresh in-memory database holding `shop`."""
    db = sqlite3.connect(":memory:")
    db.executescript(_SCHEMA)
    db.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", map(astuple, shop.customers))
    db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", map(astuple, shop.orders))
    db.executemany("INSERT INTO shipments VALUES (?, ?, ?, ?)", map(astuple, shop.shipments))
    db.commit()
    return db


def normalise_address(address: str) -> str:
    """Addresses compare case- and whitespace-insensitively."""
    return " ".join(address.split()).casefold()


def snapshot(db: sqlite3.Connection) -> dict[str, str]:
    """The mutable state: `order:ID` -> status and `address:ID` -> normalised address."""
    state = {f"order:{i}": s for i, s in db.execute("SELECT id, status FROM orders")}
    for i, address in db.execute("SELECT id, address FROM customers"):
        state[f"address:{i}"] = normalise_address(address)
    return state


# ---------------------------------------------------------------------------------- tools
# Arguments were validated against the tool schemas by the chat layer; the checks here
# only keep odd values from raising.


def _error(text: str) -> dict[str, str]:
    return {"error": text}


def _int(args: dict[str, Any], key: str) -> int | None:
    value = args.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(args: dict[str, Any], key: str) -> str | None:
    value = args.get(key)
    return value.strip() if isinstance(value, str) and value.strip() else None


def _customer(db: sqlite3.Connection, customer_id: int | None) -> dict[str, Any] | None:
    row = db.execute(
        "SELECT id, name, email, address FROM customers WHERE id = ?", (customer_id,)
    ).fetchone()
    return dict(zip(("id", "name", "email", "address"), row)) if row else None


def find_customer(db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    email = _text(args, "email")
    if email is None:
        return _error("email must be a non-empty string")
    row = db.execute("SELECT id FROM customers WHERE lower(email) = ?", (email.lower(),))
    found = row.fetchone()
    return _customer(db, found[0]) if found else _error(f"no customer with email {email}")


def list_orders(db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    customer_id = _int(args, "customer_id")
    if _customer(db, customer_id) is None:
        return _error(f"no customer with id {args.get('customer_id')}")
    rows = db.execute(
        "SELECT id, placed_at, total, status FROM orders WHERE customer_id = ? ORDER BY placed_at",
        (customer_id,),
    )
    return [dict(zip(("id", "placed_at", "total", "status"), row)) for row in rows]


def get_order(db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    order_id = _int(args, "order_id")
    row = db.execute(
        "SELECT id, customer_id, placed_at, total, status FROM orders WHERE id = ?", (order_id,)
    ).fetchone()
    if row is None:
        return _error(f"no order with id {args.get('order_id')}")
    order = dict(zip(("id", "customer_id", "placed_at", "total", "status"), row))
    shipment = db.execute(
        "SELECT carrier, status, updated_at FROM shipments WHERE order_id = ?", (order_id,)
    ).fetchone()
    order["shipment"] = (
        dict(zip(("carrier", "status", "updated_at"), shipment)) if shipment else None
    )
    return order


def refund_order(db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    """Any order that is not refunded yet can be refunded: the API trusts the agent."""
    order_id = _int(args, "order_id")
    row = db.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
    if row is None:
        return _error(f"no order with id {args.get('order_id')}")
    if row[0] == "refunded":
        return _error(f"order {order_id} is already refunded")
    db.execute("UPDATE orders SET status = 'refunded' WHERE id = ?", (order_id,))
    db.commit()
    return {"id": order_id, "status": "refunded"}


def update_address(db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    customer_id, address = _int(args, "customer_id"), _text(args, "address")
    if _customer(db, customer_id) is None:
        return _error(f"no customer with id {args.get('customer_id')}")
    if address is None:
        return _error("address must be a non-empty string")
    db.execute("UPDATE customers SET address = ? WHERE id = ?", (address, customer_id))
    db.commit()
    return {"id": customer_id, "address": address}


TOOL_FUNCTIONS: dict[str, Callable[[sqlite3.Connection, dict[str, Any]], Any]] = {
    "find_customer": find_customer,
    "list_orders": list_orders,
    "get_order": get_order,
    "refund_order": refund_order,
    "update_address": update_address,
}
