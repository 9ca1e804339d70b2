"""MkDocs hooks: add the generated command reference to the site on every build."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

_GEN = Path(__file__).with_name("gen_cli_reference.py")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", _GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    """Add ``reference.md``, rendered from the CLI's own help, to the files being built."""
    files.append(File.generated(config, "reference.md", content=_generator().render()))
    return files
