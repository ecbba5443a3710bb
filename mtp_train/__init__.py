"""mtp_train: train speculative-decoding draft heads (MTP / EAGLE) for LLMs."""

__version__ = "0.1.0"
