"""What ``PeftModel.from_pretrained`` returns under PRAG's ``use_slot``: PRAG's adapter verbs over an adapter store
and a fused slot, no LoRA modules; the active adapter is written by ``set_adapter`` or a forward pre-hook."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

from ..errors import HookError
from ..slot import PackedAdapter

# PeftModel attributes a base model also has, whose PEFT meaning the slot cannot give (others: ``__getattr__``)
_REFUSED = frozenset({"save_pretrained", "push_to_hub", "merge_adapter", "unmerge_adapter", "add_adapter",
                      "print_trainable_parameters", "get_nb_trainable_parameters", "set_additional_trainable_modules"})


class SlotPeftModel:
    """A ``PeftModel`` stand-in for PRAG's inference loop: PEFT's adapter verbs keep their meaning (the merge is the
    shim's), everything else is the base model's; training, saving and merging an active adapter are refused."""

    def __init__(self, shim: Any, base: Any, model_id: Any, adapter_name: str) -> None:
        self._shim, self._base = shim, base
        self._adapters: dict[str, PackedAdapter] = {}
        self._paths: dict[str, str] = {}
        # merge name -> (its adapters, the first one's path, w~, mode): its own recipe, as PEFT's materialised merge
        self._merges: dict[str, tuple[list[PackedAdapter], str, list[float], str]] = {}
        self._configs: dict[str, Any] = {}
        self._active: str | None = None
        self._disabled = False
        self._holding: str | None = None  # what the slot holds and has switched on for this model
        self._closed = False
        self.load_adapter(model_id, adapter_name)
        self._active = str(adapter_name)  # active, as after PEFT's from_pretrained; written at the next forward
        self._hook = base.register_forward_pre_hook(lambda module, args: self._sync())

    def load_adapter(self, model_id: Any, adapter_name: str = "default", is_trainable: bool = False,
                     **kwargs: Any) -> None:
        """Read the adapter directory ``model_id`` into the shim's store under ``adapter_name`` (no modules)."""
        self._check_open("load_adapter")
        name = str(adapter_name)
        if is_trainable:
            raise HookError(f"fcprag prag (use_slot): load_adapter('{model_id}', is_trainable=True): the fused slot "
                            "holds inference-only adapters; run without use_slot to train")
        if name in self._adapters or name in self._merges:
            raise HookError(f"fcprag prag (use_slot): an adapter named '{name}' is already loaded; "
                            f"delete_adapter('{name}') first")
        self._adapters[name] = self._shim.read_adapter(model_id, self._base)
        self._paths[name] = str(model_id)

    def add_weighted_adapter(self, adapters: Sequence[Any], weights: Sequence[float] | None = None,
                             adapter_name: str = "merge", combination_type: str = "svd", **kwargs: Any) -> None:
        """The shim's controller-weighted merge of ``adapters`` as a new (not yet active) adapter ``adapter_name``."""
        self._check_open("add_weighted_adapter")
        merge_name = str(adapter_name)
        if merge_name in self._adapters or merge_name in self._merges:
            return  # peft returns without doing anything when the name exists: keep that
        names = [str(n) for n in adapters]
        unknown = [n for n in names if n not in self._adapters]
        if unknown:
            raise HookError(f"add_weighted_adapter('{merge_name}'): adapter '{unknown[0]}' is not loaded "
                            f"(loaded: {sorted(self._adapters)})")
        packed = [self._adapters[n] for n in names]
        paths = [self._paths[n] for n in names]
        t0 = time.perf_counter()
        for n, p in zip(names, packed):
            if p.all_zero:
                raise HookError(f"adapter '{n}' loaded from {self._paths[n]}: every lora_B weight is zero, so it "
                                "would change nothing (weights not loaded, or the adapter was saved before training)")
        shim = self._shim
        ctx, fw = shim.question_weights(merge_name, names, paths, lambda: [p.to_lora() for p in packed])
        self._merges[merge_name] = (packed, paths[0], fw.merge_weights, shim.mode)  # written at set_adapter
        shim.log_merge(ctx, fw, names, paths, merge_name, {"weights": weights, "combination_type": combination_type},
                       t0, slot_info=f"FusedSlot merge of {len(names)} adapters ({shim.mode}), written at set_adapter")

    def set_adapter(self, adapter_name: str) -> None:
        self._active = self._existing("set_adapter", adapter_name)
        self._sync()  # PRAG's set_adapter('merge') is where the question's merge is written

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside the block the base model computes without any adapter (like PEFT's context manager)."""
        before, self._disabled = self._disabled, True
        try:
            yield
        finally:
            self._disabled = before

    def delete_adapter(self, adapter_name: str) -> None:
        name = self._existing("delete_adapter", adapter_name)
        for table in (self._adapters, self._merges, self._paths, self._configs):
            table.pop(name, None)
        if self._active == name:  # like PEFT: the first remaining adapter becomes active
            rest = self._names()
            self._active = rest[0] if rest else None

    def unload(self, *args: Any, **kwargs: Any) -> Any:
        """Switch the slot off, forget every adapter and return the base model (its weights were never written)."""
        self.close()
        return self._base

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> Any:
        if not self._closed and self._active is not None and not self._disabled:
            raise HookError(f"fcprag prag (use_slot): merge_and_unload() with adapter '{self._active}' active would "
                            "write it into the base weights, which the fused slot never does: call "
                            f"delete_adapter('{self._active}') or unload(), or run without use_slot")
        return self.unload()

    def get_base_model(self) -> Any:
        return self._base

    def close(self) -> None:
        """Detach from the base model: switch the slot off and remove the pre-hook (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        self._release()
        self._adapters.clear()
        self._merges.clear()
        self._active = None

    @property
    def peft_config(self) -> dict[str, Any]:
        """``{adapter name: LoraConfig}`` (a merge: a copy of its first adapter's config, ``r`` = its total rank)."""
        return {n: self._config(n) for n in self._names()}

    def _config(self, name: str) -> Any:
        if name not in self._configs:
            from peft import LoraConfig

            packed, first, _, mode = self._merges.get(name) or ([], self._paths[name], None, None)
            cfg = self._configs[name] = LoraConfig.from_pretrained(first)
            if packed:  # a merge: its first adapter's config, scaling folded in
                ranks = [p.max_rank for p in packed]
                cfg.r = cfg.lora_alpha = sum(ranks) if mode == "cat" else max(ranks)
        return self._configs[name]

    @property
    def active_adapter(self) -> str | None:
        return self._active

    @property
    def active_adapters(self) -> list[str]:
        return [] if self._active is None else [self._active]

    @property
    def base_model(self) -> "SlotPeftModel":
        return self  # PEFT's LoraModel: the same adapter verbs, the same forward

    @property
    def model(self) -> Any:
        return self._base

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._base(*args, **kwargs)

    forward = __call__

    def eval(self) -> "SlotPeftModel":
        self._base.eval()
        return self

    def train(self, mode: bool = True) -> "SlotPeftModel":
        self._base.train(mode)
        return self

    def to(self, *args: Any, **kwargs: Any) -> "SlotPeftModel":
        self._base.to(*args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        if name.startswith("_"):
            raise AttributeError(name)
        from peft import PeftModel

        if name in _REFUSED or (hasattr(PeftModel, name) and not hasattr(type(self._base), name)):
            raise HookError(f"fcprag prag (use_slot): {name} is a PeftModel feature the fused slot does not provide "
                            "(it holds inference-only merged updates, no PEFT modules): run without use_slot")
        return getattr(self._base, name)

    def __repr__(self) -> str:
        return (f"SlotPeftModel(adapters={self._names()}, active={self._active!r}, "
                f"base={type(self._base).__name__})")

    def _names(self) -> list[str]:
        return [*self._adapters, *self._merges]

    def _existing(self, verb: str, adapter_name: Any) -> str:
        """``verb``'s adapter, which must be loaded (or a merge) in an open model."""
        self._check_open(verb)
        name = str(adapter_name)
        if name not in self._adapters and name not in self._merges:
            raise HookError(f"{verb}('{name}'): no such adapter (loaded: {self._names()})")
        return name

    def _check_open(self, verb: str) -> None:
        if self._closed:
            raise HookError(f"fcprag prag (use_slot): {verb}() after unload(): this model was unloaded; use the "
                            "model unload() returned")

    def _sync(self) -> None:
        """Make the slot hold (and apply) the active adapter's update, or nothing."""
        want = None if self._disabled else self._active
        if want == self._holding:
            return
        if want is None:
            self._release()
            return
        packed, _, weights, mode = self._merges.get(want) or ([self._adapters[want]], "", [1.0], "cat")
        self._shim.slots.write_packed(self._base, packed, weights, mode)
        self._holding = want

    def _release(self) -> None:
        if self._holding is not None:
            slot = self._shim.slots.slot_of(self._base)
            if slot is not None:
                slot.deactivate()
            self._holding = None
