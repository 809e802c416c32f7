"""Speculative decoding: proposers guess tokens, the target verifies them, a governor decides when it pays."""
