"""The algorithm: the GRPO loop, ClippedPG loss with IS correction, advantages, mismatch metrics (torch only)."""
