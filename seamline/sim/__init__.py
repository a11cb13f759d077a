"""Predicting a mesh: the cost model (``costs``) and the discrete-event simulator (``simulate``).
Pure Python: no torch, so that `seamline plan` can price meshes no one here has."""
