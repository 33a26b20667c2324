"""Reward tests use the root conftest's ``gsm8k_dir`` fixture (real GSM8K from ../shared/data)."""
