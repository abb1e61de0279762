"""Megatron-core training: a pool of ranks (TP x DP) that consume, train and Push.

Nothing here imports megatron-core, torch or Ray at import time; the rank processes do.
"""
