"""A fruit shop as an MCP server (stdio): the tools of examples/mcp_shop/run.yaml.

    python examples/mcp_shop/server.py

Tools the model sees: `find_product(name)`, `add_to_cart(product, quantity)`,
`view_cart()`, `place_order()`. Hidden from it by the env: `reset()` (isolation reset
calls it as each episode starts) and `check_order(answer, info)` (a row's `score_tool`:
the share of the row's `info.items` that the placed order got right). A bad request (an
unknown product, more than the stock, an empty cart) is a tool error the model reads.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

try:  # mcp 2 renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

# product -> (unit price, stock)
CATALOG = {
    "apple": (0.5, 40), "pear": (0.75, 30), "banana": (0.25, 50), "orange": (0.6, 25),
    "mango": (1.5, 10), "kiwi": (0.4, 20), "lemon": (0.3, 15), "melon": (3.0, 5),
}  # fmt: skip

shop = MCPServer("fruit-shop")
state: dict = {"cart": {}, "orders": []}


def _total(items: dict[str, int]) -> float:
    return round(sum(CATALOG[p][0] * q for p, q in items.items()), 2)


def _product(name: str) -> str:
    key = name.strip().lower()
    key = key[:-1] if key not in CATALOG and key.endswith("s") else key
    if key not in CATALOG:
        raise ToolError(f"no product named {name!r}; we sell {', '.join(CATALOG)}")
    return key


@shop.tool()
def find_product(name: str) -> dict:
    """A product's unit price and how many are in stock."""
    key = _product(name)
    price, stock = CATALOG[key]
    return {"product": key, "price": price, "in_stock": stock - state["cart"].get(key, 0)}


@shop.tool()
def add_to_cart(product: str, quantity: Annotated[int, Field(ge=1, le=50)]) -> dict:
    """Put `quantity` of a product in the cart."""
    key = _product(product)
    held = state["cart"].get(key, 0)
    if held + quantity > CATALOG[key][1]:
        raise ToolError(f"only {CATALOG[key][1] - held} {key} left in stock")
    state["cart"][key] = held + quantity
    return {"cart": state["cart"], "total": _total(state["cart"])}


@shop.tool()
def view_cart() -> dict:
    """The cart's items and total."""
    return {"cart": state["cart"], "total": _total(state["cart"])}


@shop.tool()
def place_order() -> dict:
    """Order what is in the cart; the cart is emptied."""
    if not state["cart"]:
        raise ToolError("the cart is empty: add_to_cart first")
    items, state["cart"] = state["cart"], {}
    state["orders"].append(items)
    return {"order_id": len(state["orders"]), "items": items, "total": _total(items)}


@shop.tool()
def reset() -> str:
    """Empty the cart and forget the orders (called by the env, not the model)."""
    state["cart"], state["orders"] = {}, []
    return "ok"


@shop.tool()
def check_order(answer: str, info: dict) -> float:
    """The score tool: the share of info['items'] (product -> quantity) that the last
    placed order got right, with any extra product counted against it."""
    want = info.get("items") or {}
    got = state["orders"][-1] if state["orders"] else {}
    right = sum(1 for p, q in want.items() if got.get(p) == q)
    return right / len(set(want) | set(got)) if (want or got) else 1.0


if __name__ == "__main__":
    shop.run()
