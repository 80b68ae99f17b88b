"""Writes train.jsonl and eval.jsonl beside this file: shipment requests, each with the
`create_shipment` call it asks for.

    python examples/shipments/make_data.py      # deterministic: the files shipped here

A row: {"prompt": "...", "answer": {"sku", "quantity", "destination", "speed"}}. The SKU is
a code (`AB-1207`) that must be copied exactly (the config scores it with `match: exact`);
the speed is said in several ways ("overnight", "no rush") and answered as express or
standard, the field a small model gets wrong longest.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SKUS = ["AB-1207", "QX-88", "ZK-3410", "MP-902", "TR-5561", "LN-77", "HC-2048", "WD-415"]
CITIES = ["Lyon", "Porto", "Gdansk", "Turin", "Ghent", "Bremen", "Malmo", "Leeds"]
SPEEDS = {
    "express": ["express", "as fast as possible", "overnight"],
    "standard": ["standard", "regular", "no rush"],
}
FORMS = [
    "Ship {q} boxes of {sku} to our {city} warehouse, {said} please.",
    "Please send {q} units of item {sku} to {city} ({said}).",
    "{city} needs {q} x {sku}; {said} shipping.",
    "Create a shipment: {q} of {sku}, destination {city}, {said}.",
    "Can you get {q} cartons of {sku} over to {city}? {said}",
]


def rows(n: int, seed: int = 7) -> list[dict]:
    """n requests with distinct prompts."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        q, sku, city = rng.randint(1, 40), rng.choice(SKUS), rng.choice(CITIES)
        speed = rng.choice(list(SPEEDS))
        said = rng.choice(SPEEDS[speed])
        prompt = rng.choice(FORMS).format(q=q, sku=sku, city=city, said=said)
        if prompt not in seen:
            seen.add(prompt)
            answer = {"sku": sku, "quantity": q, "destination": city, "speed": speed}
            out.append({"prompt": prompt, "answer": answer})
    return out


def main() -> None:
    here = Path(__file__).parent
    data = rows(264)
    for name, part in (("train.jsonl", data[:200]), ("eval.jsonl", data[200:])):
        (here / name).write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    main()
