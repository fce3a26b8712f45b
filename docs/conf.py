"""Sphinx configuration for manifoldlib (built with ``sphinx-build -W -b html docs docs/_build/html``)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "manifoldlib"
author = "manifoldlib developers"
copyright = "2026, manifoldlib developers"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "results/figures/*.md"]  # the trend tool writes its table beside its figure
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "furo"
html_static_path = ["_static"]
html_title = "manifoldlib"
nitpicky = False
myst_enable_extensions = ["dollarmath"]


def _public_alias(app, env, node, contnode):
    """Link a reference written with a public alias (``manifoldlib.Sphere``,
    ``manifoldlib.charts.SEL``) to the object where the API pages render it (its defining module)."""
    import importlib

    if node.get("refdomain") != "py" or node.get("reftype") == "mod":
        return None
    parts = node["reftarget"].split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        owner = getattr(obj, rest[0], None)
        if owner is None:
            return None
        home = getattr(owner, "__module__", None)
        if not home or not isinstance(getattr(owner, "__qualname__", None), str):
            return None
        target = ".".join([home, owner.__qualname__, *rest[1:]])
        if target == node["reftarget"]:
            return None
        return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                                 target, node, contnode)
    return None


def setup(app):
    app.connect("missing-reference", _public_alias)
