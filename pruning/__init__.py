"""Structural pruning (Minitron-style width and depth). Planned; no method is registered yet."""
