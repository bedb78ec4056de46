"""``epd bench``: a serving load generator for epd, with a transformers baseline.

``workload`` makes the requests (seeded synthetic images and prompts, multi-turn conversations,
Poisson arrivals), ``load`` drives a router and times each stream, ``baseline`` runs the same
workload through transformers' ``generate``, ``metrics`` turns records into figures, ``plot``
draws them and ``run`` ties it together for the CLI.
"""
