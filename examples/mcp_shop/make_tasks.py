"""Writes train.jsonl (60 rows) and eval.jsonl (20 rows) beside this file: requests to the
fruit shop of server.py, each with the calls it needs and the answer it ends with.

    python examples/mcp_shop/make_tasks.py      # deterministic: the files shipped here

Three kinds of request: the price of one product (`find_product`, answer the price); an
order of one or two products (`add_to_cart` for each, `place_order`, answer the total);
and the same orders scored also by the server's `check_order` tool (`score_tool`, with the
order's items in `info`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

PRICES = {"apple": 0.5, "pear": 0.75, "banana": 0.25, "orange": 0.6, "mango": 1.5,
          "kiwi": 0.4, "lemon": 0.3, "melon": 3.0}  # fmt: skip
PRICE_ASKS = ["What does one {p} cost?", "How much is a {p}?", "Tell me the price of a {p}."]
ORDER_ASKS = ["Order {items}, then tell me the order total.",
              "Please buy {items} for me and say what the order cost.",
              "I'd like {items}. Place the order and give me the total."]  # fmt: skip


def _row(rng: random.Random) -> dict:
    if rng.random() < 0.25:
        product = rng.choice(list(PRICES))
        return {"prompt": rng.choice(PRICE_ASKS).format(p=product),
                "expected_calls": [{"name": "find_product", "arguments": {"name": product}}],
                "answer": str(PRICES[product])}  # fmt: skip
    products = rng.sample(list(PRICES), rng.choice((1, 2)))
    items = {p: rng.randint(1, 5) for p in products}
    text = " and ".join(f"{q} {p}{'s' if q > 1 else ''}" for p, q in items.items())
    calls = [{"name": "add_to_cart", "arguments": {"product": p, "quantity": q}}
             for p, q in items.items()] + [{"name": "place_order", "arguments": {}}]  # fmt: skip
    total = round(sum(PRICES[p] * q for p, q in items.items()), 2)
    row = {"prompt": rng.choice(ORDER_ASKS).format(items=text), "expected_calls": calls,
           "answer": f"{total:.2f}"}  # fmt: skip
    if rng.random() < 0.5:
        row.update(score_tool="check_order", info={"items": items})
    return row


def main() -> None:
    rng = random.Random(0)
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < 80:
        row = _row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    here = Path(__file__).parent
    for name, part in (("train.jsonl", rows[:60]), ("eval.jsonl", rows[60:])):
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
