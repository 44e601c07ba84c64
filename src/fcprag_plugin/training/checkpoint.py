"""Pickle-free training checkpoints in ``<out>/checkpoint``: the controller after the last finished epoch
(``config.json``, ``model.safetensors``), AdamW and RNG states (``optimizer.safetensors``, param groups in its
metadata) and ``state.json`` (epoch, history, the training arguments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..controller import FusionController
from ..controller_config import read_config, read_weights
from ..errors import FcpragError
from ..fileio import read_json_if_present, write_dir, write_json

CHECKPOINT_DIR = "checkpoint"
STATE_NAME = "state.json"  # these two names mark a checkpoint (controller.CHECKPOINT_MARKERS)
OPTIM_NAME = "optimizer.safetensors"


def save_checkpoint(out: Path, controller: FusionController, optimizer: torch.optim.Optimizer,
                    shuffle_gen: torch.Generator, state: dict[str, Any]) -> Path:
    """Write the checkpoint through the folder swap (``fileio.write_dir``): a crash never leaves half a checkpoint."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        controller.save_pretrained(tmp)
        sd = optimizer.state_dict()
        tensors = {f"state.{idx}.{k}": torch.as_tensor(v).detach().cpu().contiguous()
                   for idx, st in sd["state"].items() for k, v in st.items()}
        tensors["rng.torch"] = torch.get_rng_state()
        tensors["rng.shuffle"] = shuffle_gen.get_state()
        save_file(tensors, str(tmp / OPTIM_NAME), metadata={"param_groups": json.dumps(sd["param_groups"])})
        write_json(tmp / STATE_NAME, state)

    return write_dir(out / CHECKPOINT_DIR, fill)


def read_checkpoint_state(out: Path) -> dict[str, Any] | None:
    path = out / CHECKPOINT_DIR / STATE_NAME
    return read_json_if_present(path, FcpragError, fix=f"a corrupt checkpoint: delete {path.parent} to start over")


def load_checkpoint(out: Path, controller: FusionController, optimizer: torch.optim.Optimizer,
                    shuffle_gen: torch.Generator) -> None:
    """Restore controller weights, optimizer and RNG states in place (after :func:`read_checkpoint_state`)."""
    from safetensors import safe_open

    ckpt = out / CHECKPOINT_DIR
    saved = read_config(ckpt)  # (not from_pretrained, which refuses checkpoints: they are not controllers)
    if saved != controller.config:
        raise FcpragError(f"{ckpt / 'config.json'}: the checkpoint's controller config differs from this run's "
                          f"({saved} vs {controller.config})")
    controller.load_state_dict(read_weights(ckpt, controller.state_dict(), "cpu", saved.embed_dim))
    with safe_open(str(ckpt / OPTIM_NAME), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        for key in f.keys():
            if key.startswith("state."):
                _, idx, name = key.split(".", 2)
                opt_state.setdefault(int(idx), {})[name] = f.get_tensor(key)
        torch_rng, shuffle_rng = f.get_tensor("rng.torch"), f.get_tensor("rng.shuffle")
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    torch.set_rng_state(torch_rng)
    shuffle_gen.set_state(shuffle_rng)
