"""The ``fcprag`` command line: ``fuse``, ``inspect``, ``train``, ``eval``, ``run``, ``labels``.

Each command group lives next to the code it drives and exposes ``register(subparsers)``; this module only
assembles them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from .errors import FcpragError

# Command groups outside the core: (module, attribute). Each registers its own sub-commands.
_COMMAND_MODULES = (
    "fcprag_plugin.training.cli",
    "fcprag_plugin.hooks.cli",
    "fcprag_plugin.labels.cli",
)


def _cmd_fuse(args: argparse.Namespace) -> int:
    from .fusion import fuse

    if len(args.adapter) != len(args.passage):
        raise FcpragError(f"got {len(args.adapter)} --adapter but {len(args.passage)} --passage; pass one per adapter")
    passages = [Path(p[1:]).read_text(encoding="utf-8") if p.startswith("@") else p for p in args.passage]
    encoder = None
    if args.encoder:
        from .encoding import TextEncoder

        encoder = TextEncoder(args.encoder)
    res = fuse(args.adapter, args.query, passages, controller=args.controller, encoder=encoder, mode=args.mode,
               **({"rank": args.rank} if args.rank else {}))
    out = res.adapter.save_pretrained(args.out)
    info = {"query": args.query, "adapters": [str(a) for a in args.adapter], **res.to_json()}
    (out / "fusion.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} (mode={res.mode}, controller={res.controller_mode})")
    for a, w in zip(args.adapter, res.merge_weights):
        print(f"  w~={w:.4f}  {a}")
    print(f"  g={res.g:.4f} tau={res.tau:.4f}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .adapter import LoraAdapter

    logging.getLogger("fcprag_plugin").setLevel(logging.WARNING)
    for path in args.path:
        ad = LoraAdapter.from_pretrained(path)
        ranks = sorted(set(ad.ranks.values()))
        scalings = sorted({round(m.scaling, 6) for m in ad.modules.values()})
        targets = sorted({n.split(".")[-1] for n in ad.modules})
        norms = ad.norms()
        dn = [v["delta"] for v in norms.values()]
        print(f"{path}")
        print(f"  modules: {len(ad)}  targets: {targets}  rank: {ranks}  scaling: {scalings}  dtype: {ad.dtype}")
        print(f"  |dW|_F per module: min {min(dn):.4g}  mean {sum(dn) / len(dn):.4g}  max {max(dn):.4g}")
        print(f"  size: {ad.num_bytes() / 1e6:.3f} MB")
        if ad.is_zero():
            print("  WARNING: every lora_B is zero: this adapter does nothing")
        if args.per_module:
            for name, v in norms.items():
                print(f"    {name}: |A| {v['A']:.4g}  |B| {v['B']:.4g}  |dW| {v['delta']:.4g}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fcprag", description="Learned fusion of per-passage LoRA adapters (PRAG/DyPRAG)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fuse", help="merge passage adapters with per-query weights into one PEFT adapter directory")
    f.add_argument("--adapter", action="append", required=True, help="PEFT adapter directory (repeat, in order)")
    f.add_argument("--passage", action="append", required=True,
                   help="passage text, same order as --adapter (repeat); @FILE reads it from a file")
    f.add_argument("--query", required=True)
    f.add_argument("--controller", help="controller directory (default: uniform, PRAG's merge)")
    f.add_argument("--encoder", help="embedding model name or path (default: the controller's)")
    f.add_argument("--mode", default="cat", help="merge mode: cat (exact), separate (DyPRAG), svd")
    f.add_argument("--rank", type=int, help="target rank for --mode svd")
    f.add_argument("--out", required=True, help="output adapter directory")
    f.set_defaults(func=_cmd_fuse)

    i = sub.add_parser("inspect", help="print rank, targets, scaling, norms and warnings of adapter directories")
    i.add_argument("path", nargs="+")
    i.add_argument("--per-module", action="store_true", help="per-module norms")
    i.set_defaults(func=_cmd_inspect)

    for mod in _COMMAND_MODULES:
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod).register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "accepts_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except FcpragError as e:
        print(f"fcprag {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
