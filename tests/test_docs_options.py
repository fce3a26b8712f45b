"""Every option a docs page names exists, so a renamed or removed option cannot linger in the docs.

What is checked, on every ``docs/**/*.rst`` page but those of :data:`EXCLUDED_PAGES`:

- **command lines** (in code blocks and in inline literals): each ``--flag`` given to
  ``python -m models.train`` / ``models.compare`` / ``models.prepare`` (also under ``torchrun``)
  is one of that program's flags or, where the program takes ``--key value`` overrides, a config
  key (:func:`models.config.config_keys`); a flag with fixed choices gets one of them. Each flag
  given to ``python benchmarks/NAME.py`` is one the script's ``argparse`` parser defines (read
  from its source, not run). For ``models.train`` the whole command line is then built into a
  :class:`~models.config.TrainConfig`, so a stale value (an unknown connection or policy) fails
  as well; placeholder values (``DIR``, ``N``, ``$RUN``) are left out of that build.
- **TOML blocks**: every key is a config key (or ``preset``).
- **Python**: in ``.. code-block:: python`` blocks, every keyword argument of a call to a
  ``manifoldlib`` or ``models`` function or class (imported in the block, or a method of an
  object the block built from such a class) is a parameter of its ``inspect.signature``;
  keywords that a signature collects with ``**kwargs`` are checked where they go (a manifold's
  retraction options against the retraction class, ``build_optimizer``'s against
  ``ManifoldMuon``). Inline literals that are a call of a public name (``SEL(weight,
  init="congruent")``) are checked the same way, and so is a dict given for an options
  dataclass (``dual={"spectral": "auto"}``: each key a field of ``DualOptions``).
- **prose**: an inline ``--flag`` is a flag of one of those programs or a config key; an inline
  keyword literal (``impl="compile"``) names a parameter of some public function or class, a
  retraction option or a config key; one the page calls the default (````init="mismatched"``
  (the default)``) is the default of at least one of them.

A failure names the page, the option and the valid ones. The last tests plant a stale option of
every kind in a made-up page and check that each is reported.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib
import re
import shlex
import types
import typing

import pytest
import tomllib

from models.cli import _ArgumentError
from models.config import ConfigError, build_config, config_keys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Pages being rewritten together with ``manifoldlib.optim`` (their options change with it):
#: not checked until then. Remove a page from this list when its rewrite lands.
EXCLUDED_PAGES: tuple[str, ...] = ()

PAGES = sorted(
    str(p.relative_to(DOCS))
    for p in DOCS.rglob("*.rst")
    if "_build" not in p.parts and str(p.relative_to(DOCS)) not in EXCLUDED_PAGES
)

#: The packages whose names are checked (torch's own keywords are torch's business).
PACKAGES = ("manifoldlib", "models")
PUBLIC_MODULES = (
    "manifoldlib",
    "manifoldlib.functional",
    "manifoldlib.manifolds",
    "manifoldlib.retractions",
    "manifoldlib.nn",
    "manifoldlib.charts",
    "manifoldlib.optim",
    "manifoldlib.testing",
    "manifoldlib.distributed",
    "models",
)


# ---- reading rST -------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_CODE_DIRECTIVES = ("code-block", "code", "sourcecode")


@dataclasses.dataclass
class Page:
    """An rST page split into code blocks ``(language, body)`` and the prose around them."""

    name: str
    blocks: list[tuple[str, str]]
    prose: str


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_after(lines: list[str], start: int, indent: int) -> tuple[str, int]:
    """The indented body that follows line ``start - 1`` (options and blank lines skipped),
    dedented, and the index of the first line after it."""
    i = start
    while i < len(lines) and (not lines[i].strip() or re.match(r"^\s+:[\w-]+:", lines[i])):
        if lines[i].strip() and _indent(lines[i]) <= indent:
            break
        i += 1
    body = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    return _dedent(body), i


def _dedent(lines: list[str]) -> str:
    cut = min((_indent(l) for l in lines if l.strip()), default=0)
    return "\n".join(l[cut:] for l in lines)


def read_page(name: str, text: str | None = None) -> Page:
    """Page ``docs/NAME``, or ``text`` under that name."""
    lines = ((DOCS / name).read_text() if text is None else text).splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        m = _DIRECTIVE.match(line)
        if m and m.group(2) in _CODE_DIRECTIVES:
            body, i = _block_after(lines, i + 1, len(m.group(1)))
            blocks.append((m.group(3).strip() or "text", body))
            continue
        if m is None and line.rstrip().endswith("::") and not line.strip().startswith(".."):
            prose.append(line.rstrip()[:-1])  # "text::" reads "text:"
            body, i = _block_after(lines, i + 1, _indent(line))
            blocks.append(("text", body))
            continue
        prose.append(line)
        i += 1
    return Page(name, blocks, "\n".join(prose))


def inline_literals(prose: str) -> list[str]:
    """The ````literal```` texts of the prose, line breaks read as spaces."""
    return [
        " ".join(m.group(1).split())
        for m in re.finditer(r"(?<!`)``(?!`)(.+?)``(?!`)", prose, re.DOTALL)
    ]


# ---- command lines -----------------------------------------------------------------------------

#: ``python -m models.X`` (also after ``torchrun ... -m``) or ``python benchmarks/X.py``.
_PROGRAM = re.compile(r"(?:^|\s)(?:-m\s+(models(?:\.\w+)*)|(?:\S*/)?(benchmarks/\w+\.py))(?=\s|$)")
_SEPARATORS = {"&&", "||", "|", ";", ">", ">>", "2>&1", "&"}
#: A value that stands for the reader's own (``DIR``, ``N``, ``$RUN``, ``<path>``, ``...``).
_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_.:]*|.*[$<>{}].*|\.\.\.|.*\|.*)$")


@dataclasses.dataclass
class Program:
    """What a command-line program accepts: its flags, which take a value, and their choices."""

    name: str
    flags: set[str]
    takes_value: set[str]
    choices: dict[str, tuple[str, ...]]
    overrides: bool  # takes --key value config overrides

    def valid(self) -> list[str]:
        keys = {f"--{k}" for k in config_keys()} if self.overrides else set()
        return sorted(self.flags) + sorted(keys - self.flags)


def _from_parser(name: str, parser: argparse.ArgumentParser, overrides: bool) -> Program:
    flags, takes_value, choices = set(), set(), {}
    for action in parser._actions:
        for flag in action.option_strings:
            if not flag.startswith("--"):
                continue
            flags.add(flag)
            if action.nargs != 0:
                takes_value.add(flag)
            if action.choices is not None:
                choices[flag] = tuple(action.choices)
    return Program(name, flags, takes_value, choices, overrides)


def _benchmark_program(path: str) -> Program:
    """The flags of a benchmark script, from the ``add_argument`` calls of its source and of the
    ``benchmarks/_*.py`` helpers it imports."""
    script = ROOT / path
    sources = [script] + [
        script.parent / f"{m}.py"
        for m in re.findall(r"^(?:from|import)\s+(_\w+)", script.read_text(), re.MULTILINE)
        if (script.parent / f"{m}.py").exists()
    ]
    flags, takes_value, choices = {"--help"}, set(), {}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                continue
            names = [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            ]
            kw = {k.arg: k.value for k in node.keywords}
            flag_action = isinstance(kw.get("action"), ast.Constant) and str(
                kw["action"].value
            ).startswith(("store_true", "store_false", "count"))
            flag_action = flag_action or (
                isinstance(kw.get("action"), ast.Attribute)
                and kw["action"].attr == "BooleanOptionalAction"
            )
            for name in names:
                flags.add(name)
                if (
                    isinstance(kw.get("action"), ast.Attribute)
                    and kw["action"].attr == "BooleanOptionalAction"
                ):
                    flags.add("--no-" + name[2:])
                if not flag_action:
                    takes_value.add(name)
                if "choices" in kw:
                    try:
                        choices[name] = tuple(str(c) for c in ast.literal_eval(kw["choices"]))
                    except ValueError:
                        pass
    return Program(path, flags, takes_value, choices, overrides=False)


@functools.cache
def program(name: str) -> Program | None:
    """The program a command line runs, or None for one this test does not know."""
    if name.startswith("benchmarks/"):
        return (
            _benchmark_program(name)
            if (ROOT / name).exists()
            else Program(name, set(), set(), {}, False)
        )
    if name == "models.train":
        from models.cli import _parser

        return _from_parser(name, _parser(), overrides=True)
    if name == "models.compare":
        from models.compare.cli import _parser

        return _from_parser(name, _parser(), overrides=True)
    if name == "models.prepare":
        from models.prepare import _parser

        return _from_parser(name, _parser(), overrides=False)
    module = ROOT / name.replace(".", "/")
    if not (module.with_suffix(".py").exists() or (module / "__main__.py").exists()):
        return Program(name, set(), set(), {}, False)  # no such program
    return None


def _logical_lines(body: str) -> list[str]:
    """Shell lines of a code block: continuations joined, prompts and comments dropped."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        out.append(line)
    return out


def command_lines(page: Page) -> list[str]:
    """Every text of the page that runs a program: code-block lines and inline literals."""
    texts = inline_literals(page.prose)
    for language, body in page.blocks:
        if language != "python":
            texts += _logical_lines(body)
    return [t for t in texts if _PROGRAM.search(t)]


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in a prose fragment
        return text.split()


def check_command(text: str) -> list[str]:
    """Problems of one command line: unknown flags, values outside a flag's choices, and for
    ``models.train`` a configuration that does not build."""
    problems = []
    for m in _PROGRAM.finditer(text):
        name = m.group(1) or m.group(2)
        prog = program(name)
        if prog is None:
            continue
        if not prog.flags:
            problems.append(f"{text!r} runs {name}, which does not exist")
            continue
        args = []
        for tok in _tokens(text[m.end() :]):
            if tok in _SEPARATORS or _PROGRAM.search(" " + tok):
                break
            args.append(tok)
        problems += _check_args(prog, args, text)
    return problems


#: The synopsis's stand-in for any config key (``[--key value ...]``, ``key = value``).
SYNOPSIS_KEY = "--key"


def _options(prog: Program, args: list[str]) -> tuple[list[tuple[str, list[str]]], bool]:
    """``([(flag, values)], is_synopsis)`` of a program's arguments; a synopsis writes optional
    parts in brackets (``[--resume]``)."""
    synopsis = any(a.startswith("[") for a in args)
    args = [a.strip("[]") for a in args]
    out: list[tuple[str, list[str]]] = []
    for tok in args:
        if tok.startswith("--") and tok != "--":
            flag, eq, value = tok.partition("=")
            out.append((flag, [value] if eq else []))
        elif (
            out
            and tok not in ("", "...")
            and (out[-1][0] not in prog.flags or out[-1][0] in prog.takes_value)
        ):
            out[-1][1].append(tok)
    return out, synopsis


def _check_args(prog: Program, args: list[str], text: str) -> list[str]:
    problems = []
    keys = set(config_keys())
    options, synopsis = _options(prog, args)
    for flag, values in options:
        if flag not in prog.flags and not (
            prog.overrides
            and (flag[2:].replace("-", "_") in keys or (synopsis and flag == SYNOPSIS_KEY))
        ):
            problems.append(
                f"{text!r}: {flag} is not an option of {prog.name}; valid: "
                + ", ".join(prog.valid())
            )
        elif flag in prog.choices:
            problems += [
                f"{text!r}: {flag} {v} is not one of {', '.join(prog.choices[flag])}"
                for v in values
                if not _PLACEHOLDER.match(v) and v not in prog.choices[flag]
            ]
    if problems or synopsis or not options:  # a bare program name is a mention, not a run
        return problems
    # what the program makes of the whole command line (its own parser and config checks),
    # leaving out the options whose value stands for the reader's own
    argv = [
        part
        for flag, values in options
        if flag not in ("--help", "--config") and not any(_PLACEHOLDER.match(v) for v in values)
        for part in (flag, *values)
    ]
    try:
        _run_parser(prog.name, argv)
    except (ConfigError, ValueError, _ArgumentError) as exc:
        problems.append(f"{text!r}: {exc}")
    return problems


def _run_parser(name: str, argv: list[str]) -> None:
    """Parse ``argv`` as program ``name`` does and build its configuration, running nothing."""
    if name == "models.train":
        from models.cli import parse_args

        args, overrides = parse_args(argv)
        build_config(args.preset, overrides=overrides)
    elif name == "models.compare":
        from models.cli import flags_of
        from models.compare.cli import _parser
        from models.compare.suites import SUITES, narrow_suite
        from models.config import parse_overrides

        parser = _parser()
        args, rest = parser.parse_known_args(argv)
        overrides = parse_overrides(rest, flags_of(parser))
        narrow_suite(
            SUITES[args.suite],
            arms=args.arms,
            sweep=None if args.sweep is None else tuple(args.sweep),
            tune_seeds=args.tune_seeds,
            tuning_seeds=None if args.tuning_seeds is None else tuple(args.tuning_seeds),
        )
        build_config(overrides=overrides)


# ---- Python ------------------------------------------------------------------------------------


def _is_ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in PACKAGES


@functools.cache
def public_names() -> dict[str, object]:
    """Name -> object of every public name of :data:`PUBLIC_MODULES` that means one object."""
    seen: dict[str, set] = {}
    objects: dict[str, object] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            seen.setdefault(name, set()).add(id(obj))
            objects[name] = obj
    return {name: obj for name, obj in objects.items() if len(seen[name]) == 1}


def _parameters(fn) -> tuple[set[str], bool]:
    """``(keyword names, collects **kwargs)`` of a callable."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def registered_retractions(sources: list[str]) -> set[tuple[str, str]]:
    """``(manifold, name)`` of the ``register_retraction`` calls of a page's own examples."""
    out = set()
    for source in sources:
        out |= {
            (a, b)
            for a, b in re.findall(
                r"register_retraction\(\s*[\"'](\w+)[\"']\s*,\s*[\"']([\w.-]+)[\"']", source
            )
        }
    return out


def _forwarded(
    fn, call_keywords: dict[str, ast.expr], own: set[tuple[str, str]] = frozenset()
) -> tuple[str, object] | None:
    """Where a callable's ``**kwargs`` go: ``(description, callable)`` that checks them, or None
    when this test does not know. ``own``: retractions the page registers itself."""
    from manifoldlib.manifolds import RetractionManifold
    from manifoldlib.optim import ManifoldMuon, build_optimizer
    from manifoldlib.retractions import get_retraction

    if isinstance(fn, type) and issubclass(fn, RetractionManifold):
        name = call_keywords.get("retraction")
        if name is None:
            retraction = fn.default_retraction
        elif isinstance(name, ast.Constant) and isinstance(name.value, str):
            retraction = name.value
        else:
            return None
        if (fn.name, retraction) in own:
            return None
        cls = type(get_retraction(fn.name, retraction))  # an unknown name raises, naming the valid
        return f"{fn.__name__}(retraction={retraction!r}) options ({cls.__name__})", cls
    if fn is build_optimizer:
        return "ManifoldMuon (build_optimizer's **muon_kw)", ManifoldMuon
    if fn is ManifoldMuon:  # **replaced only turns old names into an error that names the new one
        return "ManifoldMuon", None
    return None


def _check_call(
    fn, call: ast.Call, where: str, own: set[tuple[str, str]] = frozenset()
) -> list[str]:
    if not callable(fn) or not _is_ours(fn):
        return []
    try:
        names, var_kw = _parameters(fn)
    except (TypeError, ValueError):
        return []
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    label = getattr(fn, "__qualname__", repr(fn))
    target = None
    if var_kw:
        try:
            target = _forwarded(fn, keywords, own)
        except ValueError as exc:  # an unknown retraction name
            return [f"{where}: {label}: {exc}"]
        if target is None:
            return []
    problems = []
    for kw, value in keywords.items():
        problems += check_dict_keys(kw, value, where)
    for kw in keywords:
        if kw in names:
            continue
        if target is not None and target[1] is not None:
            extra, _ = _parameters(target[1])
            if kw in extra:
                continue
            valid = sorted(names | extra)
            problems.append(
                f"{where}: {label}(..., {kw}=...): no such keyword in {label} or "
                f"{target[0]}; valid: {', '.join(valid)}"
            )
            continue
        problems.append(
            f"{where}: {label}(..., {kw}=...): no such keyword; valid: {', '.join(sorted(names))}"
        )
    return problems


class _Resolver(ast.NodeVisitor):
    """Checks the calls of one Python block, resolving names through the block's imports and
    the classes of the objects it builds."""

    def __init__(self, where: str, namespace: dict[str, object], own: set[tuple[str, str]]) -> None:
        self.where, self.own = where, own
        self.names: dict[str, object] = dict(namespace)
        self.instances: dict[str, type] = {}
        self.problems: list[str] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in PACKAGES or alias.name == "functools":
                module = importlib.import_module(alias.name)
                if alias.asname:
                    self.names[alias.asname] = module
                else:
                    self.names[alias.name.split(".")[0]] = importlib.import_module(
                        alias.name.split(".")[0]
                    )

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and (node.module.split(".")[0] in PACKAGES or node.module == "functools"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*":
                    continue
                obj = getattr(module, alias.name, None)
                if obj is None:
                    obj = importlib.import_module(f"{node.module}.{alias.name}")
                self.names[alias.asname or alias.name] = obj

    def resolve(self, node: ast.expr):
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in self.instances:
                return getattr(self.instances[node.value.id], node.attr, None)
            base = self.resolve(node.value)
            if isinstance(base, (types.ModuleType, type)):
                return getattr(base, node.attr, None)
        return None

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        if (
            isinstance(node.value, ast.Call)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            fn = self.resolve(node.value.func)
            if isinstance(fn, type) and _is_ours(fn):
                self.instances[node.targets[0].id] = fn

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        fn = self.resolve(node.func)
        if fn is functools.partial and node.args:
            fn = self.resolve(node.args[0])
        self.problems += _check_call(fn, node, self.where, self.own)


def check_python(
    source: str,
    where: str,
    namespace: dict[str, object] | None = None,
    own: set[tuple[str, str]] = frozenset(),
) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:  # a block this test cannot read would be checked by nothing
        return [f"{where} is not valid Python ({exc})"]
    resolver = _Resolver(where, namespace or {}, own)
    resolver.visit(tree)
    return resolver.problems


def python_blocks(page: Page) -> list[str]:
    return [body for language, body in page.blocks if language == "python"]


def inline_calls(page: Page) -> list[str]:
    """Inline literals that are one call of a public name (``SEL(weight, init="congruent")``)."""
    out = []
    for text in inline_literals(page.prose):
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            continue
        if isinstance(tree.body, ast.Call):
            out.append(text)
    return out


def toml_blocks(page: Page) -> list[str]:
    return [body for language, body in page.blocks if language == "toml"]


# ---- options named in prose -------------------------------------------------------------------

#: Flags of other programs that pages name (torchrun's, pip's).
FOREIGN_FLAGS = {
    "--standalone",
    "--nproc_per_node",
    "--nnodes",
    "--node_rank",
    "--rdzv_backend",
    "--rdzv_endpoint",
    "--index-url",
    "--extra-index-url",
}
#: Misspellings a page shows on purpose (what the CLI answers to them): each must stay invalid.
MISSPELLING_EXAMPLES = {"--presset", "--lrr"}
#: torch keywords that pages name in prose (``foreach=True``); they are torch's business.
FOREIGN_KEYWORDS = {
    "capturable",
    "foreach",
    "fused",
    "maximize",
    "use_orig_params",
    "init_method",
    "start_method",
    "num_threads",
    "timeout",
    "weights_only",
}


@functools.cache
def all_flags() -> frozenset[str]:
    """Every flag of every program a page may run, and ``--key`` for every config key."""
    names = {"models.train", "models.compare", "models.prepare"}
    names |= {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    flags = {f"--{k}" for k in config_keys()}
    for name in names:
        flags |= program(name).flags
    return frozenset(flags)


def _callables() -> list[object]:
    """Every public function and class of :data:`PUBLIC_MODULES` and the public methods of the
    classes, and every registered retraction class (``Sphere(retraction="p", p=...)``)."""
    from manifoldlib.retractions import MANIFOLD_NAMES, available_retractions, get_retraction

    out = []
    for obj in public_names().values():
        if not callable(obj) or not _is_ours(obj):
            continue
        out.append(obj)
        if isinstance(obj, type):
            out += [m for n, m in vars(obj).items() if not n.startswith("_") and callable(m)]
    out += [type(get_retraction(m, r)) for m in MANIFOLD_NAMES for r in available_retractions(m)]
    return out


@functools.cache
def keyword_defaults() -> dict[str, list[tuple[str, object]]]:
    """Keyword name -> ``[(owner, default)]`` over :func:`_callables` and the config keys
    (``TrainConfig`` and ``GPTConfig`` fields, whose defaults are the dataclasses')."""
    from models.config import TrainConfig

    out: dict[str, list[tuple[str, object]]] = {}
    for fn in _callables():
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                out.setdefault(p.name, []).append((getattr(fn, "__qualname__", str(fn)), p.default))
    defaults = TrainConfig().to_dict()
    for key in config_keys():
        out.setdefault(key, []).append(("the config", defaults.get(key, inspect.Parameter.empty)))
    return out


def prose_flags(page: Page) -> list[str]:
    """``--flag`` names of inline literals that run no program (``--no-compile``)."""
    return [
        flag
        for text in inline_literals(page.prose)
        if not _PROGRAM.search(text)
        for flag in re.findall(r"(?:^|\s)(--[A-Za-z][\w-]*)", text)
    ]


#: An inline keyword literal (``impl="compile"``, TOML's ``threads = 1``), and whether the page
#: calls it the default right after it (``(the default)``, ``, the default``; not ``the default
#: preset's``, which is a preset's value).
_PROSE_KEYWORD = re.compile(
    r"(?<!`)``([a-z_][a-z0-9_]*)\s*=(?!=)\s*([^`]*)``"
    r"(\s*(?:\(the default|\(default|, the default)(?! preset))?"
)


def prose_keywords(page: Page) -> list[tuple[str, str, bool]]:
    """``(keyword, value source, claimed default)`` of inline literals that are keyword
    arguments (``impl="compile"``, ``init="mismatched"`` (the default))."""
    out = []
    for m in _PROSE_KEYWORD.finditer(page.prose):
        name, value = m.group(1), " ".join(m.group(2).split())
        try:
            call = ast.parse(f"f({name}={value})", mode="eval").body
        except SyntaxError:
            call = None
        if call is None:  # ``name=`` alone, or a value that is no Python
            out.append((name, "", False))
            continue
        out += [(k.arg, ast.unparse(k.value), bool(m.group(3))) for k in call.keywords if k.arg]
    return out


def _option_classes(name: str) -> dict[str, type]:
    """Owner -> options dataclass, for the keywords ``name`` whose annotation admits one
    (``dual: DualOptions | dict``): a dict given there must use its fields."""
    out = {}
    for fn in _callables():
        try:
            hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
        except (NameError, TypeError, AttributeError):  # an annotation it cannot evaluate
            hints = {}
        for arg in typing.get_args(hints.get(name)) or (hints.get(name),):
            if dataclasses.is_dataclass(arg):
                out[f"{getattr(fn, '__qualname__', fn)}({name}=...)"] = arg
    return out


def check_dict_keys(name: str, value: ast.expr, where: str) -> list[str]:
    """A dict literal given for an options-dataclass keyword names only its fields."""
    if not isinstance(value, ast.Dict):
        return []
    keys = {k.value for k in value.keys if isinstance(k, ast.Constant)}
    problems, seen = [], set()
    for owner, cls in _option_classes(name).items():
        if cls in seen:  # the same options dataclass behind another entry point
            continue
        seen.add(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        problems += [
            f"{where}: {owner}: no option {key!r}; valid: {', '.join(sorted(fields))}"
            for key in sorted(keys - fields)
        ]
    return problems


def _claimed_default_problem(name: str, value: str, known: list[tuple[str, object]]) -> str | None:
    """Why ``name=value`` is not a default, or None when it is one (for an options dict: every
    entry is the options dataclass's default)."""
    try:
        claimed = ast.literal_eval(value)
    except ValueError:
        return None
    if isinstance(claimed, dict):
        for owner, cls in _option_classes(name).items():
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            wrong = {
                k: defaults[k] for k, v in claimed.items() if k in defaults and defaults[k] != v
            }
            if wrong:
                return (
                    f"``{name}={value}`` is called the default, but {owner}'s defaults are "
                    + ", ".join(f"{k}={v!r}" for k, v in wrong.items())
                )
        return None
    if any(default == claimed for _, default in known):
        return None
    have = "; ".join(
        f"{owner}: {default!r}"
        for owner, default in known
        if default is not inspect.Parameter.empty
    )
    return f"``{name}={value}`` is called the default, but the defaults are {have or 'none'}"


def check_prose(page: Page) -> list[str]:
    problems = []
    for flag in prose_flags(page):
        if flag in MISSPELLING_EXAMPLES or flag == SYNOPSIS_KEY:
            continue
        if flag not in all_flags() and flag not in FOREIGN_FLAGS:
            problems.append(
                f"``{flag}`` is no flag of models.train, models.compare, "
                f"models.prepare or a benchmark script, and no config key"
            )
    known = keyword_defaults()
    for name, value, claims_default in prose_keywords(page):
        if name in FOREIGN_KEYWORDS or f"--{name}" == SYNOPSIS_KEY:
            continue
        if name not in known:
            problems.append(
                f"``{name}=``: no public function or class of manifoldlib or models "
                f"takes a keyword {name!r}, and it is no config key"
            )
            continue
        problems += check_dict_keys(
            name, ast.parse(value or "None", mode="eval").body, f"``{name}={value}``"
        )
        if claims_default and (problem := _claimed_default_problem(name, value, known[name])):
            problems.append(problem)
    return problems


# ---- the tests ---------------------------------------------------------------------------------


def problems_of(name: str, text: str | None = None) -> list[str]:
    """Every option of page ``docs/NAME`` (or of ``text``) that does not exist."""
    page = read_page(name, text)
    problems = []
    for line in command_lines(page):
        problems += check_command(line)
    own = registered_retractions(python_blocks(page))
    for k, block in enumerate(python_blocks(page)):
        problems += check_python(block, f"python block {k}", own=own)
    for call in inline_calls(page):
        problems += check_python(call, f"``{call}``", public_names(), own)
    problems += check_prose(page)
    for block in toml_blocks(page):
        unknown = sorted(set(tomllib.loads(block)) - set(config_keys()) - {"preset"})
        problems += [
            f"TOML key {key!r} is not a config key; valid: {', '.join(config_keys())}"
            for key in unknown
        ]
    return problems


@pytest.mark.parametrize("name", PAGES)
def test_every_option_a_page_names_exists(name):
    problems = problems_of(name)
    assert not problems, f"docs/{name} names options that do not exist:\n" + "\n".join(problems)


def test_excluded_pages_exist():
    """An exclusion outlives its page only by mistake: a renamed page is checked again."""
    missing = [name for name in EXCLUDED_PAGES if not (DOCS / name).exists()]
    assert not missing, f"EXCLUDED_PAGES names pages that are gone: {missing}"


#: A page with one stale option of every kind the test looks for.
PLANTED = """\
Planted
=======

Run ``python -m models.train --lrate 1e-3`` or ``--no-such-flag``; ``impl="fast"`` (the default),
``dual_spectral=True``, ``dual={"spectrall": "auto"}`` and ``SEL(weight, initt="congruent")``;
``threads = 4`` (the default).

.. code-block:: bash

   python -m models.train --connection spheret --policy nope
   python -m models.compare --suite spheret --arms pre-ln no-such-arm
   python benchmarks/bench_sel.py --threads 2 --adamw nope

.. code-block:: python

   from manifoldlib import Stiefel
   from manifoldlib.optim import build_optimizer
   st = Stiefel(retraction="polar", mthod="svd")
   st.random(4, 2, dtyp=None)
   opt = build_optimizer(model, polcy="hetero")

.. code-block:: toml

   lrr = 3
"""


def test_the_checker_finds_a_stale_option_of_every_kind():
    problems = "\n".join(problems_of("planted.rst", PLANTED))
    for expected in (
        "--lrate is not an option of models.train",
        "``--no-such-flag`` is no flag",
        "``impl='fast'`` is called the default",
        "``threads=4`` is called the default",
        "takes a keyword 'dual_spectral'",
        "no option 'spectrall'",
        "SEL(..., initt=...)",
        "policy must be one of",
        "--arms unknown ['no-such-arm']",
        "--adamw nope is not one of",
        "Stiefel(..., mthod=...)",
        "random(..., dtyp=...)",
        "build_optimizer(..., polcy=...)",
        "TOML key 'lrr'",
    ):
        assert expected in problems, f"not found: {expected}\n{problems}"


def test_the_pages_examples_are_read():
    """The readers find what the pages hold (a reader that finds nothing checks nothing)."""
    pages = {name: read_page(name) for name in PAGES}
    assert len(command_lines(pages["guides/training.rst"])) >= 20
    assert sum(len(python_blocks(p)) for p in pages.values()) >= 25
    assert sum(len(inline_calls(p)) for p in pages.values()) >= 10
    assert sum(len(prose_keywords(p)) for p in pages.values()) >= 30


def test_misspelling_examples_are_misspelt_and_shown():
    shown = {flag for name in PAGES for flag in prose_flags(read_page(name))}
    for flag in MISSPELLING_EXAMPLES:
        assert flag not in all_flags(), (
            f"{flag} is an option now: drop it from MISSPELLING_EXAMPLES"
        )
        assert flag in shown, f"no page shows {flag} any more: drop it from MISSPELLING_EXAMPLES"
