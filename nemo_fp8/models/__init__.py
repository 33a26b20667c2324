"""Model helpers: HF loading and aligned log-probs; the project-built tiny model."""
