"""Ferry's packages under their names from before the `ferry` namespace: `worker.*` and `api.*`.

A checkout on `sys.path` (pytest's rootdir, `python -m` from the repository) makes the source
folders importable by their bare names. Loaded that way a module would run a second time, as a
second module with classes of its own; instead the bare name becomes an alias, so that
`from worker.engine import LLM` gives `ferry.worker.engine.LLM` itself. `kernels` gets no alias:
that top-level name belongs to Hugging Face's package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `old` and `old.*` as the already importable `new` and `new.*` modules."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.old or fullname.startswith(self.old + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.new + spec.name[len(self.old):])
        spec.loader_state = module.__spec__  # the import system stamps the alias's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own spec back: it is already loaded


def alias(old: str, new: str) -> ModuleType:
    """Make `old` (being imported now by its bare name) and its submodules the `new` modules."""
    if not any(isinstance(f, _Alias) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(old, new))
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
