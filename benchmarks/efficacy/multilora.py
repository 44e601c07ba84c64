"""Train many independent LoRA adapters at once: one adapter per sample of a batch, on one frozen model.

Each target ``nn.Linear`` gets a forward hook adding ``scaling * B_b @ A_b @ x_b`` for sample ``b``, with the
adapters' parameters stacked (``A [n, r, in]``, ``B [n, out, r]``, float32 master copies). The loss is the sum
of the per-sample mean token losses, so adapter ``b``'s gradient is exactly its own; :class:`StackedAdamW`
updates only the adapters that took part in a step, with per-adapter step counts. So training ``n`` adapters
together equals training each alone with batch size 1 and AdamW (``benchmarks/efficacy/tests/test_multilora.py``
checks it against PEFT), but one forward/backward serves the whole batch.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from fcprag_plugin import LoraAdapter
from fcprag_plugin.adapter import LoraModule


def target_linears(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """``{module path: Linear}`` for every Linear whose last name component is in ``targets``."""
    found = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in targets}
    if not found:
        raise ValueError(f"no nn.Linear named {list(targets)} in the model")
    return found


class MultiLora:
    """``n`` LoRA adapters (rank ``r``, ``alpha``) on ``model``'s target Linears; ``select(idx)`` picks which
    adapters the next batch's samples use (sample ``j`` uses adapter ``idx[j]``)."""

    def __init__(self, model: nn.Module, n: int, *, r: int, alpha: float, targets: Sequence[str],
                 seeds: Sequence[int], device: str | torch.device | None = None) -> None:
        if len(seeds) != n:
            raise ValueError(f"{n} adapters but {len(seeds)} seeds")
        self.model, self.n, self.r, self.scaling = model, n, r, alpha / r
        self.modules = target_linears(model, targets)
        # the seeded init draws on the CPU (same numbers on every device), then moves to the model's device
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        for name, lin in self.modules.items():
            A = torch.empty(n, r, lin.in_features)
            for b in range(n):  # PEFT's lora_A init: kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
                bound = 1.0 / math.sqrt(lin.in_features)
                A[b].uniform_(-bound, bound, generator=gens[b])
            self.A[name] = A.to(self.device).requires_grad_(True)
            self.B[name] = torch.zeros(n, lin.out_features, r, device=self.device, requires_grad=True)
        self.idx: torch.Tensor | None = None
        self.handles = [lin.register_forward_hook(self._hook(name)) for name, lin in self.modules.items()]

    def parameters(self) -> list[torch.Tensor]:
        return [t for name in self.modules for t in (self.A[name], self.B[name])]

    def select(self, idx: Sequence[int]) -> None:
        self.idx = torch.as_tensor(list(idx), dtype=torch.long, device=self.device)

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            if self.idx is None or x.shape[0] != len(self.idx):
                raise RuntimeError(f"{name}: batch of {x.shape[0]} samples but {None if self.idx is None else len(self.idx)} "
                                   "adapters selected")
            A = self.A[name][self.idx].to(x.dtype)  # [b, r, in]
            B = self.B[name][self.idx].to(x.dtype)  # [b, out, r]
            h = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), A.transpose(1, 2))  # [b, T, r]
            return out + (self.scaling * torch.bmm(h, B.transpose(1, 2))).reshape(out.shape)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def factor_norms(self) -> dict[str, torch.Tensor]:
        """``||s B_b A_b||_F`` per target group (the Linear's last name, e.g. ``down_proj``) over all layers, per
        adapter ``[n]``, from r x r Gram products (``||BA||_F^2 = <B^T B, A A^T>``), never forming ``dW``."""
        sq: dict[str, torch.Tensor] = {}
        for name in self.modules:
            A, B = self.A[name].float(), self.B[name].float()
            ga, gb = A @ A.transpose(1, 2), B.transpose(1, 2) @ B  # [n, r, r]
            key = name.split(".")[-1]
            sq[key] = sq.get(key, 0) + (self.scaling ** 2) * (ga * gb).sum((1, 2))
        return {k: v.clamp_min(0).sqrt().cpu() for k, v in sq.items()}

    def adapter(self, b: int, config: dict[str, Any]) -> LoraAdapter:
        """Adapter ``b`` as a :class:`LoraAdapter` (float32 copies)."""
        mods = {name: LoraModule(self.A[name][b].detach().clone(), self.B[name][b].detach().clone(), self.scaling)
                for name in self.modules}
        return LoraAdapter(mods, dict(config), source=f"<multilora {b}>")


class StackedAdamW:
    """AdamW over stacked per-adapter tensors ``[n, ...]``; ``step(active)`` updates only the active adapters,
    each with its own step count, so an adapter that sits out a step is untouched (no momentum drift)."""

    def __init__(self, params: Sequence[torch.Tensor], n: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = torch.zeros(n, dtype=torch.long)  # step counts live on the CPU; indices move to each tensor

    @torch.no_grad()
    def step(self, active: Sequence[int]) -> None:
        idx = torch.as_tensor(list(active), dtype=torch.long)
        self.t[idx] += 1
        b1, b2 = self.betas
        t = self.t[idx].to(torch.float64)
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)
            bc1 = (1 - b1 ** t).to(device=p.device, dtype=p.dtype).view(shape)
            bc2 = (1 - b2 ** t).to(device=p.device, dtype=p.dtype).view(shape)
            idx = idx.to(p.device)
            g = p.grad[idx]
            mi = m[idx].mul_(b1).add_(g, alpha=1 - b1)
            vi = v[idx].mul_(b2).addcmul_(g, g, value=1 - b2)
            m[idx], v[idx] = mi, vi
            pi = p[idx]
            if self.wd:
                pi.mul_(1 - self.lr * self.wd)
            pi.addcdiv_(mi / bc1, (vi / bc2).sqrt_().add_(self.eps), value=-self.lr)
            p[idx] = pi

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def sample_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample mean next-token loss ``[b]`` (labels ``-100`` ignored), float32."""
    lg = logits[:, :-1].float()
    tg = labels[:, 1:]
    ce = nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=-100,
                                     reduction="none").view(tg.shape)
    count = (tg != -100).sum(1).clamp_min(1)
    return ce.sum(1) / count


def lm_losses(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
    """Same as ``sample_losses(model(...).logits, labels)`` but the output projection and the softmax run only
    at labelled positions (a QA sample labels its few answer tokens, not its prompt): ``[b]`` float32."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    tgt = labels[:, 1:]
    sel = tgt != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # [M, V]
    ce = nn.functional.cross_entropy(logits, tgt[sel], reduction="none")
    rows = torch.arange(tgt.shape[0], device=tgt.device).unsqueeze(1).expand_as(tgt)[sel]
    total = torch.zeros(tgt.shape[0], dtype=ce.dtype, device=ce.device).index_add(0, rows, ce)
    return total / sel.sum(1).clamp_min(1)
