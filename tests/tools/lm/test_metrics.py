"""Label builder: text metrics, answer extraction, teacher-forced log-probability, prompt rendering."""

from __future__ import annotations

import json

import pytest
import torch

from fcprag_plugin.errors import FcpragError
from fcprag_tools.lm.metrics import (
    answer_in_text,
    answer_logprob,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
)
from fcprag_tools.lm.prompts import PromptTemplate, answer_ids, render_prompt
from helpers import tiny_model, tiny_tokenizer


# ----------------------------------------------------------------------------- text metrics
def test_normalize_answer_squad_style():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_f1_hand_computed_and_max_over_aliases():
    # pred tokens [cat, sat], gold [cat, sat, down]: p = 1, r = 2/3, f1 = 0.8
    assert f1_score("The cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    # pred [new, york, city], gold [york]: p = 1/3, r = 1, f1 = 0.5; alias "New York City" is exact
    assert f1_score("New York City", ["York"]) == pytest.approx(0.5)
    assert f1_score("New York City", ["York", "new york city"]) == pytest.approx(1.0)
    assert f1_score("Berlin", ["Paris"]) == 0.0


def test_answer_in_text_finds_a_normalised_alias_as_whole_words_anywhere_in_the_generation():
    assert answer_in_text("I think it was The Eiffel Tower, built 1889.", ["eiffel tower"]) == 1.0
    assert answer_in_text("Paris", ["Berlin", "paris"]) == 1.0  # any alias
    assert answer_in_text("I don't know.", ["no"]) == 0.0  # whole words: "no" is not in "know"
    assert answer_in_text("No, it is not.", ["no"]) == 1.0
    assert answer_in_text("Parisian food", ["Paris"]) == 0.0
    assert answer_in_text("the answer", ["The"]) == 0.0  # an alias that normalises to nothing never counts
    assert answer_in_text("", ["x"]) == 0.0


def test_f1_yes_no_rule():
    assert f1_score("yes it is", ["yes"]) == 0.0  # standard token F1 would give 0.5
    assert f1_score("Yes.", ["yes"]) == 1.0
    assert f1_score("no", ["noanswer"]) == 0.0


def test_exact_match():
    assert exact_match("the Paris", ["paris"]) == 1.0
    assert exact_match("Paris France", ["paris", "rome"]) == 0.0
    assert exact_match("Rome", ["paris", "rome"]) == 1.0


def test_extract_answer_direct_and_cot():
    assert extract_answer(" Paris, France.\nMore text") == "Paris"
    assert extract_answer("Paris") == "Paris"
    cot = "Paris is in France. The capital is Paris. So the answer is Paris.\nDone"
    assert extract_answer(cot, cot=True) == "Paris"
    assert extract_answer("The Answer Is: Rome, obviously", cot=True) == ": Rome"
    assert normalize_answer(extract_answer("The Answer Is: Rome, obviously", cot=True)) == "rome"
    assert extract_answer("no marker here. x", cot=True) == "no marker here"
    assert extract_answer(".", cot=False) == ""


# ----------------------------------------------------------------------------- teacher forcing
def test_answer_logprob_equals_minus_loss_on_answer_tokens():
    model = tiny_model(seed=3)
    prompt, ans = [2, 5, 9, 17, 4], [30, 31, 7]
    got = answer_logprob(model, prompt, ans)
    ids = torch.tensor([prompt + ans])
    labels = torch.tensor([[-100] * len(prompt) + ans])
    with torch.no_grad():
        ref = -float(model(input_ids=ids, labels=labels).loss)  # HF's own shifted cross-entropy
    assert got == pytest.approx(ref, abs=1e-5)
    # And by hand, token by token, one prefix at a time (no shared forward pass).
    manual = []
    for t in range(len(ans)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ans[:t]])).logits[0, -1]
        manual.append(float(torch.log_softmax(logits.double(), -1)[ans[t]]))
    assert got == pytest.approx(sum(manual) / len(manual), abs=1e-5)


# ----------------------------------------------------------------------------- prompts
def test_render_prompt_modes_plain_tokenizer():
    tok = tiny_tokenizer()
    tpl = PromptTemplate()
    p = render_prompt(tok, tpl, "What is the capital of France?", ["Paris is a city.", "Rome is old."], "param")
    assert "Passage" not in p.text and p.text.endswith("The answer is")
    assert p.ids[0] == tok.bos_token_id
    c = render_prompt(tok, tpl, "What is the capital of France?", ["Paris is a city.", "Rome is old."], "combine")
    assert "Passage 1: Paris is a city.\nPassage 2: Rome is old." in c.text
    cot = render_prompt(tok, tpl, "Who?", ["x"], "param", cot=True)
    assert tpl.cot.strip() in cot.text and not cot.text.rstrip().endswith("The answer is")
    a = answer_ids(tok, p, "Paris")
    assert tok.decode(p.ids + a, skip_special_tokens=True).endswith("the answer is paris")


def test_render_prompt_uses_chat_template_when_present():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    tpl = PromptTemplate(system="Be brief.")
    p = render_prompt(tok, tpl, "Who wrote the book?", None, "param")
    assert p.text.startswith("[system] Be brief.\n[user] Answer the question")
    assert p.text.endswith("[assistant] The answer is")
    off = render_prompt(tok, tpl, "Who wrote the book?", None, "param", use_chat_template=False)
    assert "[user]" not in off.text


def test_prompt_template_file_errors(tmp_path):
    f = tmp_path / "tpl.json"
    f.write_text(json.dumps({"param": "Q: {question}", "answer_prefix": "A:"}))
    tpl = PromptTemplate.from_file(f)
    assert tpl.param == "Q: {question}" and tpl.answer_prefix == "A:" and tpl.combine == PromptTemplate().combine
    f.write_text(json.dumps({"parm": "Q: {question}"}))
    with pytest.raises(FcpragError, match=r"tpl\.json: unknown key 'parm'"):
        PromptTemplate.from_file(f)
    f.write_text(json.dumps({"combine": "Q: {question}"}))
    with pytest.raises(FcpragError, match=r"key 'combine' must contain the placeholder \{passages\}"):
        PromptTemplate.from_file(f)
    f.write_text("{not json")
    with pytest.raises(FcpragError, match=r"tpl\.json:1: not valid JSON"):
        PromptTemplate.from_file(f)
    with pytest.raises(FcpragError, match="unknown prompt mode 'both'"):
        PromptTemplate().user_message("q", None, "both", False)
