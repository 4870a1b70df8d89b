"""Stalwart: PyTorch-native large language model pre-training at scale."""

__version__ = "0.1.0"
