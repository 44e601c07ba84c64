"""The efficacy study's batched adapter trainer equals training each adapter alone with PEFT + torch AdamW."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from multilora import MultiLora, StackedAdamW, sample_losses

TARGETS = ["gate_proj", "up_proj", "down_proj"]


def _seqs(seed: int, n: int, lengths: list[int], vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i],), generator=g) for i in range(n)]


def _pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)], mask[i, :len(s)] = s, s, 1
    return ids, labels, mask


def _peft_alone(model, A0: dict, steps: list[torch.Tensor], lr: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One adapter alone: PEFT LoRA with the given A init, torch AdamW, one sequence per step."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=2, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                key = name.replace("base_model.model.", "", 1)
                mod.lora_A["default"].weight.copy_(A0[key])
                mod.lora_B["default"].weight.zero_()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for seq in steps:
        ids = seq[None]
        logits = pm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        sample_losses(logits, ids.clone()).sum().backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            key = name.replace("base_model.model.", "", 1)
            out[key] = (mod.lora_A["default"].weight.detach().clone(), mod.lora_B["default"].weight.detach().clone())
    pm.unload()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_training_equals_each_adapter_alone(kind):
    torch.manual_seed(0)
    model = tiny_model(kind).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.config.vocab_size
    n, lr = 3, 3e-3
    # step plan: adapter 1 sits out step 1 (as when a passage has no rewrite), lengths differ (padding)
    plan = [[0, 1, 2], [0, 2], [0, 1, 2]]
    seqs = {(k, b): s for k, step in enumerate(plan)
            for b, s in zip(step, _seqs(k, len(step), [5 + 2 * b + k for b in step], vocab))}
    ml = MultiLora(model, n, r=2, alpha=32, targets=TARGETS, seeds=[11, 12, 13])
    A0 = {b: {name: ml.A[name][b].detach().clone() for name in ml.modules} for b in range(n)}
    opt = StackedAdamW(ml.parameters(), n, lr=lr)
    for k, step in enumerate(plan):
        ml.select(step)
        ids, labels, mask = _pad([seqs[(k, b)] for b in step])
        logits = model(input_ids=ids, attention_mask=mask).logits
        sample_losses(logits, labels).sum().backward()
        opt.step(step)
        opt.zero_grad()
    ml.remove()
    assert not any(True for m in ml.modules.values() if m._forward_hooks)
    trained_any = False
    for b in range(n):
        ref = _peft_alone(model, A0[b], [seqs[(k, b)] for k, step in enumerate(plan) if b in step], lr)
        for name, (A, B) in ref.items():
            torch.testing.assert_close(ml.A[name][b].detach(), A, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(ml.B[name][b].detach(), B, rtol=1e-4, atol=1e-6)
            trained_any |= bool(B.abs().max() > 0)
    assert trained_any  # the comparison is not between two untouched zero tensors


def test_adapter_export_reproduces_the_hooked_forward():
    """The exported LoraAdapter, activated with the library, gives the same logits as the training hooks."""
    from fcprag_plugin import activate

    torch.manual_seed(1)
    model = tiny_model("llama").float().eval()
    ml = MultiLora(model, 2, r=2, alpha=32, targets=TARGETS, seeds=[1, 2])
    with torch.no_grad():
        for name in ml.modules:
            ml.B[name].normal_(0, 0.05)
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    ml.select([1])
    with torch.no_grad():
        hooked = model(input_ids=ids).logits
    ml.remove()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with activate(model, ml.adapter(1, {"r": 2, "lora_alpha": 32})):
            lib = model(input_ids=ids).logits
    assert not torch.allclose(hooked, plain)
    torch.testing.assert_close(lib, hooked, rtol=1e-5, atol=1e-5)


def test_selected_batch_size_mismatch_is_an_error():
    model = tiny_model("llama").float().eval()
    ml = MultiLora(model, 2, r=2, alpha=32, targets=TARGETS, seeds=[1, 2])
    ml.select([0])
    with pytest.raises(RuntimeError, match="batch of 2 samples but 1 adapters"):
        model(input_ids=torch.ones(2, 3, dtype=torch.long))
    ml.remove()


def test_lm_losses_equal_full_logits_losses():
    from multilora import lm_losses

    torch.manual_seed(2)
    model = tiny_model("qwen2").float().eval()
    ids = torch.randint(3, model.config.vocab_size, (3, 9))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    labels = ids.clone()
    labels[0, :5] = -100  # a QA sample: loss on its answer only
    labels[2, 6:] = -100  # padding
    with torch.no_grad():
        ref = sample_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        got = lm_losses(model, ids, mask, labels)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_train_group_trains_every_adapter_and_never_the_base():
    import adapters as stage

    from helpers import tiny_tokenizer

    torch.manual_seed(4)
    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = tiny_tokenizer()
    tok.chat_template = None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    augs = [{"passage": "paris is the capital of france .", "rewrite": "the capital of france is paris .",
             "qa_pairs": [{"question": "what is the capital of france ?", "answer": "paris"}]},
            {"passage": "berlin is a city in germany .", "rewrite": None,
             "qa_pairs": [{"question": "where is berlin ?", "answer": "germany"},
                          {"question": "what is berlin ?", "answer": "city"}]}]
    ml, stats = stage.train_group(model, tok, augs, [1, 2], epochs=2, max_tokens=32)
    assert [s["steps"] for s in stats] == [6, 6]  # (passage, rewrite, qa0) and (passage, qa0, qa1), twice
    assert set(stats[0]["loss_at_step"]) == {"passage", "rewrite", "qa0"}
    assert set(stats[1]["loss_at_step"]) == {"passage", "qa0", "qa1"}
    assert set(stats[0]["loss_after"]) == {"passage", "qa0"}
    for s in stats:  # two epochs on a sample lower its loss
        assert s["loss_after"]["passage"] < s["loss_at_step"]["passage"]
    for b in range(2):
        assert all(float(ml.B[n][b].abs().max()) > 0 for n in ml.modules)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m._forward_hooks for m in ml.modules.values())
