"""Load terraform/ with python-hcl2 into plain dicts (quotes stripped, block markers dropped)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hcl2

TERRAFORM = Path(__file__).resolve().parents[2] / "terraform"


def _clean(value):
    if isinstance(value, dict):
        return {_unquote(k): _clean(v) for k, v in value.items() if k != "__is_block__"}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str):
        return _unquote(value)
    return value


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


@dataclass(frozen=True)
class Block:
    kind: str  # resource | data | variable | output | module | ...
    type: str  # resource/data type, or "" for variables/outputs/modules
    name: str
    body: dict
    path: Path  # the .tf file


def load_dir(directory: Path) -> list[Block]:
    """Every labelled block of every .tf file in `directory` (not recursive)."""
    blocks = []
    for path in sorted(directory.glob("*.tf")):
        with open(path) as f:
            doc = _clean(hcl2.load(f))
        for kind in ("resource", "data"):
            for entry in doc.get(kind, []):
                for rtype, named in entry.items():
                    for name, body in named.items():
                        blocks.append(Block(kind, rtype, name, body, path))
        for kind in ("variable", "output", "module"):
            for entry in doc.get(kind, []):
                for name, body in entry.items():
                    blocks.append(Block(kind, "", name, body, path))
        for entry in doc.get("terraform", []):
            blocks.append(Block("terraform", "", "", entry, path))
        for entry in doc.get("locals", []):
            blocks.append(Block("locals", "", "", entry, path))
    return blocks


def module_dirs() -> list[Path]:
    return sorted(p for p in (TERRAFORM / "modules").iterdir() if p.is_dir())


def one(blocks: list[Block], kind: str, rtype: str, name: str | None = None) -> Block:
    found = [b for b in blocks if b.kind == kind and b.type == rtype and (name is None or b.name == name)]
    assert len(found) == 1, f"expected one {kind} {rtype} {name or ''}, found {len(found)}"
    return found[0]


def first(value):
    """A nested block parses as a list of one dict."""
    return value[0] if isinstance(value, list) else value
