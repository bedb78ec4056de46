"""Other serving systems ``epd bench`` can run the same workload through (``--baseline vllm``)."""
