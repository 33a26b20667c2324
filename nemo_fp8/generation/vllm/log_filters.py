"""Log records of vLLM that are false alarms for this project's refit, dropped with the reason.

Installed in every vLLM worker process by ``worker_extension`` (imported there before the model is built).

``RotaryEmbedding: Failed to load weights`` (vLLM 0.22, ``model_executor/model_loader/reload/layerwise.py``,
``finalize_layerwise_processing``): the layerwise reload counts every parameter and buffer of a module as
loadable (``reload/utils.get_layer_size`` sums ``_buffers``), including the rotary embedding's
``cos_sin_cache``, a non-persistent buffer computed from the config (``rotary_embedding/base.py``:
``register_buffer("cos_sin_cache", ..., persistent=False)``) that no checkpoint or trainer ever holds. So on
every refit the rotary module loads 0 of its ``load_numel_total`` elements, vLLM logs the warning and puts the
kept cache back (``_place_kernel_tensors``): the cache is unchanged and correct. Only that message, for
rotary classes (names ending ``RotaryEmbedding``), is dropped; the same warning for any other layer (a weight
that really did not arrive) still shows.
"""

from __future__ import annotations

import logging

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_TO_LOAD = "%s: Failed to load weights"


class RotaryReloadFilter(logging.Filter):
    """Drops ``<...>RotaryEmbedding: Failed to load weights`` (module docstring); passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == FAILED_TO_LOAD and args and str(args[0]).endswith("RotaryEmbedding"))


def install_log_filters() -> None:
    """Add ``RotaryReloadFilter`` to vLLM's layerwise-reload logger once (idempotent)."""
    target = logging.getLogger(LAYERWISE_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in target.filters):
        target.addFilter(RotaryReloadFilter())
