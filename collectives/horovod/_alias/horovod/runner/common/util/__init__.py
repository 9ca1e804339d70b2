"""``horovod.runner.common.util`` under ``dtrun --horovod`` (``env`` only)."""
