"""mtp_train: train speculative-decoding draft heads (MTP / EAGLE) for LLMs."""

from mtp_train.cpu_kinds import apply_cpu_kind_env

__version__ = "0.1.0"

apply_cpu_kind_env()  # MTP_TRAIN_CPU_AS: cap torch's instructions before anything loads it (cpu_kinds.py)
