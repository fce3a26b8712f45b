"""Every public name of the finished packages has a docstring, an API page and a test.

A public name is one listed in a package's ``__all__``. *Documented* means the module that
defines it is rendered by an ``.. automodule::`` (with members) in ``docs/api/*.rst``, or the name
has its own ``.. autofunction::`` / ``.. autoclass::``, and the defining module lists it in its
own ``__all__`` (autodoc renders exactly those members). *Tested* means some test file other than
this one mentions the name as a word.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = (
    "manifoldlib",
    "manifoldlib.functional",
    "manifoldlib.retractions",
    "manifoldlib.manifolds",
    "manifoldlib.nn",
    "manifoldlib.charts",
    "manifoldlib.testing",
    "manifoldlib.distributed",
    "models.gpt",
    "models.connections",
    "manifoldlib.optim",
    "models.data",
    "models.sources",
    "models.tokenizer",
    "models.shards",
    "models.prepare",
    "models.train",
    "models.run_dir",
    "models.config",
    "models.compare",
)


def _api_directives() -> tuple[set[str], set[str]]:
    """(modules rendered with members, objects rendered one by one) in docs/api/*.rst."""
    modules, objects = set(), set()
    for page in sorted((ROOT / "docs" / "api").glob("*.rst")):
        text = page.read_text()
        for match in re.finditer(r"^\.\. automodule:: (\S+)\n((?:   :.*\n)*)", text, re.MULTILINE):
            if ":no-members:" not in match.group(2):
                modules.add(match.group(1))
        objects.update(re.findall(r"^\.\. auto(?:function|class|data):: (\S+)", text, re.MULTILINE))
    return modules, objects


def _test_text() -> str:
    me = pathlib.Path(__file__).resolve()
    return "\n".join(
        path.read_text() for path in sorted((ROOT / "tests").rglob("*.py")) if path.resolve() != me
    )


MODULES, OBJECTS = _api_directives()
TESTS = _test_text()
PUBLIC = [
    (package, name)
    for package in PACKAGES
    for name in importlib.import_module(package).__all__
]


def _is_constant(obj) -> bool:
    return not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj))


def _home(package: str, name: str) -> str:
    """The module whose ``__all__`` defines ``name`` (constants have no ``__module__``)."""
    obj = getattr(importlib.import_module(package), name)
    if inspect.ismodule(obj):
        return obj.__name__
    if not _is_constant(obj):
        return obj.__module__
    for module_name in sorted(MODULES | {package}):
        if module_name.startswith(package) or package.startswith(module_name):
            module = importlib.import_module(module_name)
            listed = name in getattr(module, "__all__", ()) and getattr(module, name, None) is obj
            if listed and module_name in MODULES:
                return module_name
    # not rendered with a module: the submodule that assigns it (its '#:' comment is there)
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith(package + ".") and getattr(module, name, None) is obj:
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                continue
            if re.search(rf"^{re.escape(name)}\b.*=", source, re.MULTILINE):
                return module_name
    return package


@pytest.mark.parametrize("package,name", PUBLIC, ids=[f"{p}.{n}" for p, n in PUBLIC])
def test_public_name_has_docstring(package, name):
    obj = getattr(importlib.import_module(package), name)
    if _is_constant(obj):
        home = importlib.import_module(_home(package, name))
        source = inspect.getsource(home)
        assert re.search(rf"^#: .+\n{re.escape(name)}\b", source, re.MULTILINE), (
            f"constant {name} in {home.__name__} needs a '#:' doc comment"
        )
    else:
        assert (inspect.getdoc(obj) or "").strip(), f"{package}.{name} has no docstring"


@pytest.mark.parametrize("package,name", PUBLIC, ids=[f"{p}.{n}" for p, n in PUBLIC])
def test_public_name_is_in_an_api_page(package, name):
    home = _home(package, name)
    direct = f"{home}.{name}" in OBJECTS or f"{package}.{name}" in OBJECTS
    obj = getattr(importlib.import_module(package), name)
    if inspect.ismodule(obj):  # a subpackage: its page renders its modules
        rendered = any(m == home or m.startswith(home + ".") for m in MODULES | OBJECTS)
    else:
        rendered = home in MODULES and name in getattr(importlib.import_module(home), "__all__", ())
    assert direct or rendered, f"{package}.{name} (defined in {home}) is on no docs/api page"


@pytest.mark.parametrize("package,name", PUBLIC, ids=[f"{p}.{n}" for p, n in PUBLIC])
def test_public_name_is_used_by_a_test(package, name):
    assert re.search(rf"\b{re.escape(name)}\b", TESTS), f"no test mentions {package}.{name}"
