"""Prefix-cache snapshots: the hot part of an engine's KV cache saved to a store and restored at start-up."""
