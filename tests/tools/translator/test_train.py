"""Training with DyPRAG's recipe: one step's losses and gradients equal DyPRAG's formulas computed independently (the
double, dense deltas, HF-style losses); the loss goes down on planted data; an interrupted run resumes and ends bit for
bit where an uninterrupted one ends; a finished folder is loaded; other options are refused in one line."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fcprag_plugin import LoraAdapter, LoraModule
from fcprag_tools.lm.prompts import PromptTemplate, answer_ids, render_prompt
from fcprag_tools.translator import (Translator, TranslatorError, TranslatorOptions, TranslatorShape,
                                     passage_embeddings, train_translator)
from fcprag_tools.translator.train import applied, train_step, training_text
from helpers import TINY_WORDS, assert_bit_identical, state_snapshot, tiny_model, tiny_tokenizer

from .double import dense_hooks, double_for, dyprag_embedding


def _model():
    return tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0), tiny_tokenizer()


def _planted(model, tok, n=8, seed=0):
    """``n`` augmentation rows in the tiny vocabulary and PRAG adapters (scaling 16, PRAG's alpha 32 / r 2) made by a
    hidden translator from the passages' embeddings: data a translator can learn."""
    words = [w for w in TINY_WORDS if w.isalpha()]
    r = random.Random(seed)
    augs = {f"p{i}": {"passage": " ".join(r.choice(words) for _ in range(12)),
                      "qa_pairs": [{"question": f"what is the {r.choice(words)} ?", "answer": r.choice(words)}]}
            for i in range(n)}
    hidden = Translator(TranslatorShape.from_config(model.config, width=8), seed=99, init_std=0.3)
    with torch.no_grad():
        f = hidden(passage_embeddings(model, tok, [augs[p]["passage"] for p in sorted(augs)]))
    prag = {pid: LoraAdapter({path: LoraModule(A[j].clone(), B[j].clone() * 0.1, 16.0) for path, (A, B) in f.items()},
                             {"r": 2, "lora_alpha": 32}) for j, pid in enumerate(sorted(augs))}
    return augs, prag


def test_the_training_text_is_the_first_pair_asked_with_the_passage_and_answered():
    _, tok = _model()
    aug = {"passage": "paris is the capital of france",
           "qa_pairs": [{"question": "what is the capital ?", "answer": "paris"}, {"question": "x", "answer": "y"}]}
    ids, labels = training_text(tok, aug)
    prompt = render_prompt(tok, PromptTemplate(), "what is the capital ?", [aug["passage"]], "combine")
    assert "Passage 1: paris is the capital of france" in prompt.text
    assert ids == prompt.ids + answer_ids(tok, prompt, "paris") and labels == ids  # the loss on every token
    assert training_text(tok, {"passage": aug["passage"], "qa_pairs": []})[0] == tok(aug["passage"])["input_ids"]
    assert len(training_text(tok, aug, max_tokens=5)[0]) == 5
    with pytest.raises(TranslatorError, match="passage 'x': its text has 1 token"):
        training_text(tok, {"passage": "", "qa_pairs": []}, pid="x")


def test_one_step_has_dyprags_losses_and_gradients():
    model, tok = _model()
    augs, prag = _planted(model, tok, n=1)
    ours = Translator(TranslatorShape.from_config(model.config, width=8), seed=2, init_std=0.2)
    double = double_for(model, 2, 8)
    double.load_state_dict(ours.state_dict())
    ids, _ = training_text(tok, augs["p0"])
    emb = dyprag_embedding(model, tok, augs["p0"]["passage"])
    # DyPRAG's step, independently: dense deltas, HF's shifted LM loss, KL 'batchmean' (batch 1, no padding), MSE
    out = double(emb)
    pre = "base_model.model."
    teacher_d = {k[len(pre):-len(".lora_A.weight")]: m.scaling * m.B.double() @ m.A.double()
                 for k, m in ((pre + n + ".lora_A.weight", m) for n, m in prag["p0"].modules.items())}
    student_d = {k[len(pre):-len(".lora_A.weight")]: out[k.replace("lora_A", "lora_B")].double() @ out[k].double()
                 for k in out if k.endswith("lora_A.weight")}
    x = torch.tensor([ids])
    with torch.no_grad(), dense_hooks(model, teacher_d):
        t_logits = model(x).logits.float()
    with dense_hooks(model, student_d):
        s_logits = model(x).logits.float()
    lm = F.cross_entropy(s_logits[0, :-1], x[0, 1:])
    kl = F.kl_div(F.log_softmax(s_logits, -1), F.softmax(t_logits, -1), reduction="batchmean")
    mse = sum(F.mse_loss(out[pre + n + f".lora_{f}.weight"], getattr(m, f)) for n, m in prag["p0"].modules.items()
              for f in "AB")
    (lm + 0.01 * kl + 100 * mse).backward()
    lm, kl, mse = lm.detach(), kl.detach(), mse.detach()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    got = train_step(model, tok, ours, opt, passage_embeddings(model, tok, [augs["p0"]["passage"]]), [(ids, ids)],
                     [("p0", prag["p0"])])
    assert got["lm"] == pytest.approx(float(lm), rel=1e-4) and got["kl"] == pytest.approx(float(kl), rel=1e-3)
    assert got["mse"] == pytest.approx(float(mse), rel=1e-5) and float(kl) > 1e-3
    assert got["loss"] == pytest.approx(float(lm + 0.01 * kl + 100 * mse), rel=1e-5)
    grads = dict(double.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-3, atol=1e-7)


def test_the_loss_goes_down_on_planted_data_and_the_model_is_untouched(tmp_path):
    model, tok = _model()
    augs, prag = _planted(model, tok)
    before = state_snapshot(model)
    seen = []
    tr, st = train_translator(model, tok, augs, prag.__getitem__, TranslatorOptions(epochs=5, learning_rate=1e-2,
                                                                                    width=8), tmp_path / "t",
                              progress=lambda done, total: seen.append((done, total)))
    first, last = st["epoch_losses"][0], st["epoch_losses"][-1]
    assert last["loss"] < 0.6 * first["loss"] and last["mse"] < 0.6 * first["mse"]
    assert seen[0] == (0, 40) and seen[-1] == (40, 40) and len(seen) == 41
    assert st["steps"] == 40 and st["passages"] == 8 and st["seconds"] > 0 and len(st["history"]) == 40
    assert_bit_identical(model, before)
    assert all(p.requires_grad for p in model.parameters())  # given back as it was
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["train.json", "translator.pt"]


def test_an_interrupted_run_resumes_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    model, tok = _model()
    augs, prag = _planted(model, tok, n=5)
    opts = TranslatorOptions(epochs=2, learning_rate=1e-2, width=8, checkpoint_every=3, batch_size=2)
    whole, st_whole = train_translator(model, tok, augs, prag.__getitem__, opts, tmp_path / "a")

    def stop(done, total):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_translator(model, tok, augs, prag.__getitem__, opts, tmp_path / "b", progress=stop)
    assert (tmp_path / "b" / "train_state.pt").is_file() and not (tmp_path / "b" / "translator.pt").exists()
    resumed, st = train_translator(model, tok, augs, prag.__getitem__, opts, tmp_path / "b")
    assert st["resumed_at"] == 3 and st["history"] == st_whole["history"]
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    # a finished folder is loaded, not trained again
    again, st_again = train_translator(model, tok, augs, prag.__getitem__, opts, tmp_path / "b",
                                       progress=lambda *a: pytest.fail("trained again"))
    assert st_again == st and all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                                      resumed.state_dict().values()))
    with pytest.raises(TranslatorError, match=r"train\.json: this folder holds a translator trained on other passages "
                                              r"or with other options"):
        train_translator(model, tok, augs, prag.__getitem__, TranslatorOptions(epochs=3, width=8), tmp_path / "b")


def test_options_and_inputs_are_checked_in_one_line(tmp_path):
    model, tok = _model()
    for bad, msg in ((dict(epochs=0), "'epochs' must be an integer >= 1, got 0"),
                     (dict(learning_rate=float("nan")), "'learning_rate' must be a finite number > 0, got nan"),
                     (dict(width=2.5), "'width' must be an integer >= 1, got 2.5")):
        with pytest.raises(TranslatorError, match=msg):
            train_translator(model, tok, {"p": {}}, lambda p: None, TranslatorOptions(**bad), tmp_path)
    with pytest.raises(TranslatorError, match="no passages"):
        train_translator(model, tok, {}, lambda p: None, None, tmp_path)
    with pytest.raises(TranslatorError, match=r"the model has no module 'model\.layers\.0\.mlp\.fc1'"):
        with applied(model, {"model.layers.0.mlp.fc1": (torch.zeros(1, 2, 32), torch.zeros(1, 48, 2))}):
            pass
    augs, prag = _planted(model, tok, n=2)
    broken = LoraAdapter({k: m for k, m in prag["p1"].modules.items() if "layers.1.mlp.up_proj" not in k})
    with pytest.raises(TranslatorError, match=r"adapter of passage 'p1' \(<memory>\) has no module "
                                              r"'model\.layers\.1\.mlp\.up_proj'"):
        train_translator(model, tok, augs, {"p0": prag["p0"], "p1": broken}.__getitem__,
                         TranslatorOptions(width=8), tmp_path / "x")
