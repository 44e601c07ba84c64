"""Version differences live in ``fcprag_plugin/compat.py`` only (its docstring; issue 52): no other file of ``src/``
reads a version or probes a library for one. Read from the source (``ast``), a probe is: an import of
``importlib.metadata`` / ``packaging`` / ``pkg_resources``; a read of ``__version__`` or ``version_info``; reading a
function's signature (``inspect.signature`` and kin); ``getattr`` / ``hasattr`` with a constant name on torch,
transformers, peft, sentence-transformers, gguf (or anything imported from them); a ``try`` that imports from them
(or reads their attributes) and catches ``ImportError`` / ``AttributeError``; a comparison or attribute of
``compat.package_version(...)`` (printing it in a message is fine). The scanner itself is checked on planted probes.
A probe of an object (``getattr(model, "get_embedding_dimension")``) reads like duck typing and is left to review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
COMPAT = SRC / "fcprag_plugin" / "compat.py"
VERSIONED = {"torch", "transformers", "peft", "sentence_transformers", "gguf", "safetensors", "huggingface_hub",
             "tokenizers", "accelerate"}
VERSION_READERS = {"importlib.metadata", "importlib_metadata", "packaging", "pkg_resources"}
SIGNATURE_READERS = {"signature", "getfullargspec", "getargspec", "getcallargs"}
# What reads like a probe but decides no version difference: (file under src/, what the scanner says) -> why.
NOT_PROBES = {
    ("fcprag_plugin/training/trainer.py", "imports importlib.metadata"):
        "records the installed versions in a trained controller's provenance; decides nothing",
    ("fcprag_plugin/hosts/prag.py", "reads inspect.signature"):
        "binds a call's arguments to peft's own add_weighted_adapter to read them, the same on every version",
    ("fcprag_tools/lm/model_io.py", "tries to import transformers.modeling_gguf_pytorch_utils"):
        "every supported transformers has it (GGUF from 4.41); the guard leaves a broken install's ImportError to "
        "load_model's one-line error",
}


def _root(node: ast.AST) -> str | None:
    """The name an expression such as ``torch.cuda.x`` or ``f(a).b`` starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _bound_to(tree: ast.Module) -> dict[str, str]:
    """``{name: dotted module}`` for every name the file binds by importing (``from transformers.integrations import
    ggml`` binds ``ggml`` to ``transformers.integrations.ggml``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


def _top(module: str | None) -> str:
    return (module or "").split(".")[0]


def _guarded(body: list[ast.stmt], catches: str, bound: dict[str, str]) -> list[str]:
    """What a ``try`` body that ``catches`` these errors imports from a versioned library (``ImportError``), or which
    of their attributes it reads (``AttributeError``)."""
    got = []
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if "ImportError" in catches or "ModuleNotFoundError" in catches:
            if isinstance(node, ast.Import):
                got += [f"import {a.name}" for a in node.names if _top(a.name) in VERSIONED]
            elif isinstance(node, ast.ImportFrom) and _top(node.module) in VERSIONED:
                got += [f"import {node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                    == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                    and _top(str(node.args[0].value)) in VERSIONED:
                got.append(f"import {node.args[0].value}")
        if "AttributeError" in catches and isinstance(node, ast.Attribute) \
                and _top(bound.get(_root(node) or "")) in VERSIONED:
            got.append(f"read {ast.unparse(node)}")
    return got


def probes(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every version probe in a module's source."""
    tree = ast.parse(source)
    bound, found = _bound_to(tree), []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, f"imports {m}") for m in dict.fromkeys(
                m for m in names if m in VERSION_READERS or _top(m) in VERSION_READERS)]
            found += [(node.lineno, f"reads {m}") for m in names if m in {f"inspect.{n}" for n in SIGNATURE_READERS}]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr in ("__version__", "version_info"):
                found.append((node.lineno, f"reads {ast.unparse(node)}"))
            elif node.attr in SIGNATURE_READERS and bound.get(_root(node) or "") == "inspect":
                found.append((node.lineno, f"reads inspect.{node.attr}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and _top(bound.get(_root(node.args[0]) or "")) in VERSIONED:
            found.append((node.lineno, f"probes {ast.unparse(node.args[0])} for {node.args[1].value!r}"))
        elif isinstance(node, ast.Try):
            catches = " ".join(ast.unparse(h.type) for h in node.handlers if h.type)
            found += [(node.lineno, f"tries to {m}") for m in dict.fromkeys(_guarded(node.body, catches, bound))]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) \
                == "package_version" and isinstance(parents.get(node), (ast.Compare, ast.Attribute)):
            found.append((node.lineno, f"decides on {ast.unparse(parents[node])}"))
    return found


def _found_in_src() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path != COMPAT:
            for line, what in probes(path.read_text(encoding="utf-8")):
                out.setdefault((path.relative_to(SRC).as_posix(), what), []).append(line)
    return out


def test_no_file_but_compat_reads_a_version():
    found = _found_in_src()
    stray = [f"src/{f}:{lines[0]}: {what}" for (f, what), lines in found.items() if (f, what) not in NOT_PROBES]
    assert not stray, ("version probes outside src/fcprag_plugin/compat.py (ask compat a named question "
                       f"instead): {stray}")
    assert not set(NOT_PROBES) - set(found), f"NOT_PROBES lists what is gone: {sorted(set(NOT_PROBES) - set(found))}"


PLANTED = [
    ("import importlib.metadata as md\nv = md.version('peft')\n", "imports importlib.metadata"),
    ("from importlib import metadata\n", "imports importlib.metadata"),
    ("from packaging.version import Version\n", "imports packaging.version"),
    ("import peft\nold = peft.__version__ < '0.19'\n", "reads peft.__version__"),
    ("import sys\nnew = sys.version_info >= (3, 11)\n", "reads sys.version_info"),
    ("import inspect\nimport transformers\nn = inspect.signature(transformers.AutoModel.from_pretrained)\n",
     "reads inspect.signature"),
    ("from inspect import signature\n", "reads inspect.signature"),
    ("import torch\nf = getattr(torch.compiler, 'is_compiling', None)\n", "probes torch.compiler for 'is_compiling'"),
    ("from transformers.integrations import ggml\nold = hasattr(ggml, 'load_dequant_gguf_tensor')\n",
     "probes ggml for 'load_dequant_gguf_tensor'"),
    ("from peft import PeftModel\nok = hasattr(PeftModel, 'set_requires_grad')\n",
     "probes PeftModel for 'set_requires_grad'"),
    ("try:\n    from peft import ArrowConfig\nexcept ImportError:\n    ArrowConfig = None\n",
     "tries to import peft.ArrowConfig"),
    ("import importlib\ntry:\n    m = importlib.import_module('transformers.cache_utils')\n"
     "except (ModuleNotFoundError, ValueError):\n    m = None\n", "tries to import transformers.cache_utils"),
    ("import torch\ntry:\n    E = torch.OutOfMemoryError\nexcept AttributeError:\n    E = None\n",
     "tries to read torch.OutOfMemoryError"),
    ("from fcprag_plugin.compat import package_version\nold = package_version('peft') < package_version('torch')\n",
     "decides on package_version('peft') < package_version('torch')"),
    ("from fcprag_plugin import compat\nfive = compat.package_version('transformers').major >= 5\n",
     "decides on compat.package_version('transformers').major"),
]
NOT_PLANTED = [
    "from ..compat import package_version\nlog.info('peft %s', package_version('peft'))\nm = f'{package_version(x)}'\n",
    "try:\n    import bm25s\nexcept ImportError:\n    bm25s = None\n",  # an optional package, not a version
    "import torch\nb = getattr(torch.backends, dev.type, None)\nw = getattr(model, 'weight', None)\n",
    "import inspect\nok = inspect.isclass(x)\n__version__ = '0.1.0'\n",
]


@pytest.mark.parametrize("source, what", PLANTED, ids=[w for _, w in PLANTED])
def test_the_scanner_finds_a_planted_probe(source, what):
    assert what in [w for _, w in probes(source)], probes(source)


@pytest.mark.parametrize("source", NOT_PLANTED)
def test_the_scanner_leaves_what_reads_no_version(source):
    assert probes(source) == []
