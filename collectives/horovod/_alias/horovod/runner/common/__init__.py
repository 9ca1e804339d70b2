"""``horovod.runner.common`` under ``dtrun --horovod`` (``util.env`` only)."""
