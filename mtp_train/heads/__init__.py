"""Draft heads: the MTP head with restored norms and its EAGLE-1 ablation (`DraftHead`), their config
(`HeadConfig`) and the native head files (`save_head` / `load_head`)."""

from mtp_train.heads.config import HeadConfig
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.io import load_head, read_head_config, save_head

__all__ = ["DraftHead", "HeadConfig", "load_head", "read_head_config", "save_head"]
