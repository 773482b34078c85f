"""Speculative decoding: drafters, the verify-length policy, rejection sampling, statistics."""
