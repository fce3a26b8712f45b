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
