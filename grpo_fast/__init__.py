"""grpo-fast: GRPO loss, log-probs and group advantages without tokens x vocab logits."""
