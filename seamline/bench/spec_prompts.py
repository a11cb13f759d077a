"""The prompts ``seamline bench spec`` streams: fixed here, printed in its JSON.

``edit`` asks for a whole function back with one name changed (most of the answer is in the
prompt: the case speculation is for); ``quote`` asks for a passage back with its typos fixed;
``open`` asks for a story (little to copy: speculation must not cost it speed).
"""

from __future__ import annotations

EDIT_FUNCTION = '''def summarize_orders(orders, discount_rate, tax_rate):
    """Return the totals of a list of orders after discount and tax."""
    subtotal = 0.0
    item_count = 0
    largest_order = None
    for order in orders:
        order_total = 0.0
        for line in order["lines"]:
            price = line["price"]
            quantity = line["quantity"]
            order_total += price * quantity
            item_count += quantity
        if largest_order is None or order_total > largest_order["total"]:
            largest_order = {"id": order["id"], "total": order_total}
        subtotal += order_total
    discount = subtotal * discount_rate
    taxed = (subtotal - discount) * (1 + tax_rate)
    average = subtotal / len(orders) if orders else 0.0
    return {
        "subtotal": subtotal,
        "discount": discount,
        "total": taxed,
        "items": item_count,
        "average": average,
        "largest": largest_order,
    }
'''

QUOTE_PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every "
    "morning he climbed them again to put it out. The ships that passed never knew his name, but "
    "they trusted his light more then they trusted their own charts. One winter a storm broke the "
    "great lens, and for three nights the keeper kept a fire burning on the gallery insted, feeding "
    "it with driftwood and the legs of his own chairs. When the supply boat finally came, the "
    "captain found him asleep beside the ashes, and the sea below was calm and empty and safe."
)

WORKLOADS: dict[str, str] = {
    "edit": "Rename the variable subtotal to gross_amount in this Python function. Reply with the whole "
            "function and nothing else.\n\n" + EDIT_FUNCTION,
    "quote": "Repeat this passage exactly, fixing only its two spelling mistakes:\n\n" + QUOTE_PASSAGE,
    "open": "Write a short story about a fox and a crow who argue about who owns a piece of cheese.",
}
