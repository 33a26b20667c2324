"""Lab code the tools share (not part of the nemo_fp8 package): the ~200M small model builder
(``small``), the arithmetic-chain reasoning task it can be SFT-ed on instead (``chains``), random-weight
Qwen3-shaped checkpoints (``random_checkpoint``) and the learning-parity report tables (``parity_report``). A tool
run as ``python tools/<name>.py`` has ``tools/`` on its path and imports them as ``lab.<module>``; the tests do the
same (pytest's ``pythonpath = ["tools"]``)."""
