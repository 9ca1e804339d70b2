"""Build of the one compiled part: collectives._fastshm (a C extension, optional).

Everything else is in pyproject.toml. Without a C compiler and Python's headers the
install still succeeds, and collectives falls back to its pure-Python paths (slower
small allreduces; `python -m dtrun.collectives.smoke` says which is in use).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "dtrun.collectives._fastshm", ["collectives/_fastshm.c"],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing"],
    optional=True,
)])
