"""What the coordinator and the nodes both speak, so that neither imports the other: invites,
the relay's wire constants, link and speed probes, and the fragment server a node and the
coordinator both run."""
