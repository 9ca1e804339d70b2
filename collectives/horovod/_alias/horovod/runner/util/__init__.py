"""``horovod.runner.util`` under ``dtrun --horovod`` (``threads`` only)."""
