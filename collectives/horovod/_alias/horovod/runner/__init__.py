"""``horovod.runner`` under ``dtrun --horovod``: only the helpers Horovod's tests import
(``util.threads.in_thread``, ``common.util.env.get_env_rank_and_size``); dtrun itself is the
launcher, so ``horovodrun`` and ``horovod.run`` have no counterpart."""
