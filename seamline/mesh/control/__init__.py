"""The control plane: the coordinator, invites, the fragment server, and `seamline serve`'s mesh."""
