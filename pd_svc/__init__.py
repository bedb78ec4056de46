"""Aggregated role: prefill and decode of one language model as one engine on one device."""
