"""Pickle-free training checkpoints in ``<out>/checkpoint``: the controller after the last finished epoch
(``config.json``, ``model.safetensors``), AdamW and RNG states (``optimizer.safetensors``, param groups in its
metadata) and ``state.json`` (epoch, history, the training arguments)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Collection

import torch

from ..controller import FusionController
from ..controller_config import read_config, read_weights
from ..errors import FcpragError, kw
from ..fileio import read_json_if_present, write_dir, write_json

logger = logging.getLogger(__name__)

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


def resumable_state(out: Path, now: dict[str, Any], free: Collection[str]) -> dict[str, Any] | None:
    """The state of the checkpoint in ``out`` (None: none, said in the log) when a run that would save ``now`` at its
    start may go on from it: the same arguments (but ``free``), precision and labels; else an error naming them."""
    ckpt, state = out / CHECKPOINT_DIR, read_checkpoint_state(out)
    if state is None:
        logger.warning("%s: no checkpoint: the network trains from its start", ckpt)
        return None
    old, new = state.get("args", {}), now["args"]
    diff = sorted(k for k in set(old) | set(new) if k not in free and old.get(k) != new.get(k))
    if diff:
        both = ", ".join(f"{kw(k, new.get(k))} (the checkpoint has {kw(k, old.get(k))})" for k in diff)
        raise FcpragError(f"{ckpt}: cannot resume, argument(s) {diff} differ from the checkpoint: {both}",
                          params=[(k, v.get(k)) for k in diff for v in (new, old)])
    saved = state.get("precision", now["precision"])
    if saved != now["precision"]:
        raise FcpragError(f"{ckpt}: cannot resume, the checkpoint trained in {saved} but this run would use "
                          f"{now['precision']}; pass {kw('precision', saved)}", params=[("precision", saved)])
    if state.get("info_label_sha256") != now["info_label_sha256"]:
        raise FcpragError(f"{ckpt}: cannot resume, the label file(s) changed since the checkpoint (sha256 differs)")
    return state


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
