"""Decode role: continues handed-off requests token by token and streams the tokens."""
