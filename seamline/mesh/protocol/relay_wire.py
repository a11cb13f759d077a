"""What both ends of a relayed link and the coordinator's relay agree on (``mesh/control/relay.py``
pairs the ends): the magic each connection opens with, the ticket's length, and how long the
first end waits for the second."""

from __future__ import annotations

RELAY_MAGIC = b"SLRY"
PROBE_MAGIC = b"SLPR"  # the coordinator's reachability probe: a node closes it without a word
TICKET_CHARS = 32
PAIR_WAIT_S = 30.0  # a ticket's first end waits this long for the second
