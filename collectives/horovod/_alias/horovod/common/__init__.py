"""``horovod.common`` under ``dtrun --horovod``: the parts Horovod's scripts and tests import
(``util``, ``exceptions``); Horovod's C++ core has no counterpart here."""
