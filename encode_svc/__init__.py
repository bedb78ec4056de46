"""Encode role: Ray-managed encoder replicas that turn images into vision embeddings in the store."""
