"""Every name the API reference renders has a docstring.

mkdocstrings silently leaves out a member without a docstring, and ``mkdocs build --strict`` has no option
to fail on one, so this is the check. It finds the modules the docs render (``::: module`` lines under
``docs/``), loads them with griffe (what mkdocstrings itself reads), and requires a docstring on each
exported name (``__all__``) and on each public method or property those classes define.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]
_DIRECTIVE = re.compile(r"^::: *([\w.]+) *$", re.MULTILINE)


def rendered_modules() -> list[str]:
    """Modules named by a ``::: module`` directive in any page of the docs."""
    return sorted({m for page in (ROOT / "docs").rglob("*.md") for m in _DIRECTIVE.findall(page.read_text())})


def _has_docstring(obj: griffe.Object | griffe.Alias) -> bool:
    return obj.docstring is not None and bool(obj.docstring.value.strip())


def undocumented(module: str, src: Path = ROOT / "src") -> list[str]:
    """Exported names of ``module``, and public methods of its exported classes, that have no docstring."""
    mod = griffe.load(module, search_paths=[str(src)])
    assert mod.exports, f"{module} has no __all__: the API reference would render nothing from it"
    missing = []
    for name in mod.exports:
        obj = mod[name]
        obj = obj.final_target if obj.is_alias else obj
        if not _has_docstring(obj):
            missing.append(name)
        if obj.is_class:
            for member in obj.members.values():  # declared here, not inherited
                if member.is_function and not member.name.startswith("_") and not _has_docstring(member):
                    missing.append(f"{name}.{member.name}")
    return missing


def test_the_api_reference_renders_the_package() -> None:
    assert "ranksafe" in rendered_modules()


@pytest.mark.parametrize("module", rendered_modules())
def test_every_rendered_name_has_a_docstring(module: str) -> None:
    assert undocumented(module) == []


def test_the_check_sees_a_missing_docstring(tmp_path: Path) -> None:
    """The control: a package with one documented and one undocumented export is caught."""
    pkg = tmp_path / "src" / "demo_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        '__all__ = ["good", "bad", "Thing"]\n'
        'def good():\n    """Documented."""\n'
        "def bad():\n    pass\n"
        'class Thing:\n    """Documented."""\n'
        "    def method(self):\n        pass\n"
        "    def _private(self):\n        pass\n"
    )
    assert sorted(undocumented("demo_pkg", tmp_path / "src")) == ["Thing.method", "bad"]
