"""A package of the user's own, written for one test: its modules' sources under ``tmp_path``,
importable (also by the reward pool's worker processes, which inherit ``sys.path``) until the test
ends, then forgotten so the next test's package of the same name is imported afresh."""

import contextlib
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator


@contextlib.contextmanager
def user_package(tmp_path: Path, monkeypatch, name: str, modules: Dict[str, str]) -> Iterator[None]:
    """Package ``name`` with ``modules`` ({module: source}), on the path inside the block."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module, source in modules.items():
        (pkg / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield
    finally:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
