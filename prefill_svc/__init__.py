"""Prefill role: the language model builds a prompt's state and hands it to decode."""
