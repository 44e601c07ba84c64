"""The stacked passage-adapter trainer equals training each adapter alone with PEFT + torch AdamW."""

from __future__ import annotations

import pytest
import torch

from fcprag_tools.study import adapters as ad
from helpers import tiny_model, tiny_tokenizer

TARGETS = ["gate_proj", "up_proj", "down_proj"]


def _losses(logits, labels):
    """Per-sample mean next-token loss from full logits (the reference for ``lm_losses``)."""
    lg, tg = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=-100,
                                           reduction="none").view(tg.shape)
    return ce.sum(1) / (tg != -100).sum(1).clamp_min(1)


def _pad(seqs):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)], mask[i, :len(s)] = s, s, 1
    return ids, labels, mask


def _peft_alone(model, A0, steps, lr):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=2, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    mods = {n.replace("base_model.model.", "", 1): m for n, m in pm.named_modules()
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}
    with torch.no_grad():
        for key, m in mods.items():
            m.lora_A["default"].weight.copy_(A0[key])
            m.lora_B["default"].weight.zero_()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for seq in steps:
        ids = seq[None]
        _losses(pm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids.clone()).sum().backward()
        opt.step()
        opt.zero_grad()
    out = {k: (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
           for k, m in mods.items()}
    pm.unload()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stacked_training_equals_each_adapter_alone_with_peft(kind):
    torch.manual_seed(0)
    model = tiny_model(kind).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    n, lr = 3, 3e-3
    plan = [[0, 1, 2], [0, 2], [0, 1, 2]]  # adapter 1 sits out step 1 (a passage without a rewrite)
    g = torch.Generator().manual_seed(1)
    seqs = {(k, b): torch.randint(3, 128, (5 + 2 * b + k,), generator=g) for k, step in enumerate(plan) for b in step}
    ml = ad.MultiLora(model, n, r=2, alpha=32, targets=TARGETS, seeds=[11, 12, 13])
    A0 = {b: {name: ml.A[name][b].detach().clone() for name in ml.modules} for b in range(n)}
    opt = ad.StackedAdamW(ml.parameters(), n, lr=lr)
    for k, step in enumerate(plan):
        ml.select(step)
        ids, labels, mask = _pad([seqs[(k, b)] for b in step])
        ad.lm_losses(model, ids, mask, labels).sum().backward()
        opt.step(step)
        opt.zero_grad()
    ml.remove()
    trained = False
    for b in range(n):
        ref = _peft_alone(model, A0[b], [seqs[(k, b)] for k, step in enumerate(plan) if b in step], lr)
        for name, (A, B) in ref.items():
            torch.testing.assert_close(ml.A[name][b].detach(), A, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(ml.B[name][b].detach(), B, rtol=1e-4, atol=1e-6)
            trained |= bool(B.abs().max() > 0)
    assert trained


def test_exported_adapter_reproduces_the_hooked_forward_and_saves(tmp_path):
    from fcprag_plugin import LoraAdapter, activate

    torch.manual_seed(1)
    model = tiny_model("llama").float().eval()
    ml = ad.MultiLora(model, 2, r=2, alpha=32, targets=TARGETS, seeds=[1, 2])
    with torch.no_grad():
        for name in ml.modules:
            ml.B[name].normal_(0, 0.05)
    ids = torch.randint(3, 128, (1, 7))
    ml.select([1])
    with torch.no_grad():
        hooked = model(input_ids=ids).logits
    ml.remove()
    ad.save_adapter(ml.adapter(1, dict(ad.LORA, task_type="CAUSAL_LM")), tmp_path / "a")
    assert not list(tmp_path.glob(".*"))  # no temp folder left
    with torch.no_grad(), activate(model, LoraAdapter.from_pretrained(tmp_path / "a")):
        lib = model(input_ids=ids).logits
    torch.testing.assert_close(lib, hooked, rtol=1e-5, atol=1e-5)


def test_lm_losses_equal_full_logits_losses():
    torch.manual_seed(2)
    model = tiny_model("qwen2").float().eval()
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 6:] = -100
    with torch.no_grad():
        torch.testing.assert_close(ad.lm_losses(model, ids, mask, labels),
                                   _losses(model(input_ids=ids, attention_mask=mask).logits, labels),
                                   rtol=1e-5, atol=1e-6)


def test_train_stacked_trains_every_adapter_and_never_the_base():
    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    augs = [{"passage": "paris is the capital of france .", "rewrite": "the capital of france is paris .",
             "qa_pairs": [{"question": "what is the capital of france ?", "answer": "paris"}]},
            {"passage": "berlin is a city in germany .", "rewrite": None,
             "qa_pairs": [{"question": "where is berlin ?", "answer": "germany"},
                          {"question": "what is berlin ?", "answer": "city"}]}]
    data = [ad.samples_for(tok, a, 32) for a in augs]
    ml, stats = ad.train_stacked(model, tok, data, [1, 2], epochs=1)
    assert [s["steps"] for s in stats] == [3, 3]
    assert set(stats[0]["loss"]) == {"passage", "rewrite", "qa0"} and set(stats[1]["loss"]) == {"passage", "qa0", "qa1"}
    assert all(float(ml.B[n][b].abs().max()) > 0 for n in ml.modules for b in range(2))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in ml.modules.values())


def test_a_group_out_of_device_memory_trains_in_halves_to_the_same_adapters(monkeypatch, caplog):
    """A simulated out-of-memory error for steps of more than one sample: the group of 3 is trained one adapter at
    a time instead, with one log line, and gives the same adapters and stats as the whole group at once."""
    import logging

    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = tiny_tokenizer()
    augs = [{"passage": f"{w} is a city in {c} .", "rewrite": f"the city {w} lies in {c} .",
             "qa_pairs": [{"question": f"where is {w} ?", "answer": c}]}
            for w, c in (("paris", "france"), ("berlin", "germany"), ("rome", "italy"))]
    data = [ad.samples_for(tok, a, 32) for a in augs]
    whole, whole_stats = ad.train_stacked(model, tok, data, [5, 6, 7])
    real, sizes = ad.lm_losses, []

    def losses(m, ids, mask, labels):
        sizes.append(ids.shape[0])
        if ids.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(m, ids, mask, labels)

    monkeypatch.setattr(ad, "lm_losses", losses)
    with caplog.at_level(logging.WARNING):
        ml, stats = ad.train_stacked(model, tok, data, [5, 6, 7])
    assert sizes[0] == 3 and set(sizes[1:]) == {1}
    assert [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()] == [
        "adapter training: out of device memory at a batch of 3; going on with batches of 1"]
    assert stats == whole_stats and ml.n == 3
    cfg = dict(ad.LORA, task_type="CAUSAL_LM")
    for b in range(3):
        got, want = ml.adapter(b, cfg), whole.adapter(b, cfg)
        for name in want.modules:
            torch.testing.assert_close(got.modules[name].A, want.modules[name].A, rtol=0, atol=1e-6)
            torch.testing.assert_close(got.modules[name].B, want.modules[name].B, rtol=0, atol=1e-6)
        assert float(got.modules[name].B.abs().max()) > 0
    assert not any(m._forward_hooks for m in model.modules())
