"""Run plumbing: phase timer, metrics logger, checkpoints."""
