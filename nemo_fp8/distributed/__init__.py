"""Generic Ray parts, below the engines: starting the cluster (``cluster``), placement groups and bundles
(``placement``), the fan-out of one call to a group of actors (``fanout``), bounded teardown (``teardown``) and the
refit's weight-sync transports (``weight_sync``). The policy's and the engines' worker groups live beside their
backends: ``nemo_fp8.policy.group``, ``nemo_fp8.generation.group``."""
