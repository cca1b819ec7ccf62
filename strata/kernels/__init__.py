"""Grouped-decode operations: torch references and the cyext kernels behind one dispatch."""
