"""Checkpoint save/load (atomic, verified, reshardable) and safe loading."""
