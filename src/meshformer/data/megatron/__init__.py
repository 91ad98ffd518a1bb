"""Megatron-LM's indexed datasets (`.bin`/`.idx`) and their blends, read and written without Megatron."""
