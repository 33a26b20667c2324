"""``policy.model_name`` as NeMo-RL users write it: a local HF folder or a Hugging Face hub id.

A name that is not an existing local path and has the hub's ``org/name`` shape
(``meta-llama/Llama-3.1-8B-Instruct``) is resolved through ``huggingface_hub.snapshot_download``: the
local cache first (``local_files_only=True``, honours ``HF_HUB_CACHE`` / ``HF_HOME``), then the hub
(also ``HF_HUB_OFFLINE``, ``HF_TOKEN``). Only what a run reads is fetched: configs, tokenizer files and
safetensors weights.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFoundError(FileNotFoundError):
    """``policy.model_name`` is neither a local folder nor a hub id that could be fetched (names the id)."""


def is_hub_id(name: str) -> bool:
    """``org/name`` shaped and not an existing local path (``./``, ``../``, ``/`` and ``~`` always mean local)."""
    return (not name.startswith((".", "/", "~")) and _HUB_ID.fullmatch(name) is not None
            and not Path(name).exists())


def is_tiny_build_target(name: str, build_if_missing: bool) -> bool:
    """Whether a missing ``policy.model_name`` folder may be filled with the project's tiny model.

    Only with ``policy.tiny_model.build_if_missing``, and only into a path that is plainly local (``./``,
    ``../``, ``/``, ``~``) or whose folder names the tiny model (``tiny`` in its name, as the shipped configs'
    ``models/tiny-qwen3-arith``). Any other ``org/name`` is a hub id: offline it fails with the hub's error
    rather than quietly training a 1.8M-parameter model in a folder named ``Qwen/Qwen3-0.6B``.
    """
    if not build_if_missing:
        return False
    return name.startswith((".", "/", "~")) or not is_hub_id(name) or "tiny" in Path(name).name.lower()


TINY_BUILD_HINT = ("policy.tiny_model.build_if_missing builds the tiny model only into a local path (./..., /...) "
                   "or a folder whose name contains 'tiny'")


@functools.lru_cache(maxsize=8)
def resolve_hub_model(name: str) -> Path:
    """The local snapshot folder of hub model ``name`` (cache first, then a download).

    Raises:
        ModelNotFoundError: neither in the cache nor fetchable (no network, unknown or gated id); the
            message names the id and the cache folder.
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError) or a partial cache: try the hub
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:
        raise ModelNotFoundError(
            f"policy.model_name: {name!r} is not a local folder, not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and could not be fetched from the hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); check the id, network and HF_TOKEN, or point it at "
            "a local checkpoint folder") from None
