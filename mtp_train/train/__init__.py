"""Training: losses (`losses`: chunked logit distillation, feature loss, k-step unroll)."""
