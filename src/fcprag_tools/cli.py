"""The ``fcprag`` command line: ``fuse`` and ``inspect`` here; ``train`` / ``eval`` (:mod:`.train_cli`), ``run``
(:mod:`.run_cli`), ``labels`` (:mod:`.label_builder.cli`) and ``study`` (:mod:`.study.cli`) each expose
``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import BARE, FcpragError
from fcprag_plugin.fileio import write_json

from . import run_cli, train_cli
from .label_builder import cli as labels_cli
from .study import cli as study_cli, report_cli
from .options import (ENCODER, CliParser, add_flag, check_out_dir, finite_float, keywords_to_flags, positive_int,
                      read_text_arg, write_dir_atomically)

# fuse()'s keyword arguments -> `fcprag fuse`'s flags, for the library's messages (options.keywords_to_flags)
FUSE_FLAGS = {
    "retrieval_ranks": "--retrieval-rank",
    "retrieval_scores": "--retrieval-score",
    "controller": "--controller",
    "encoder": "--encoder",
    "mode": "--mode",
    "rank": "--rank",
}


def _check_svd_rank(args: argparse.Namespace, adapters: Sequence[Any]) -> None:
    """``--rank`` only with ``--mode svd``, and at most the rank of the exact ``cat`` merge (``positive_int`` has
    refused ``--rank`` < 1 already)."""
    if args.rank is None:
        return
    if args.mode != "svd":
        raise FcpragError(f"--rank {args.rank} is only used by --mode svd (got --mode {args.mode}); drop --rank or "
                          "pass --mode svd")
    per_module: Counter[str] = Counter()
    for ad in adapters:
        per_module.update(ad.ranks)
    full = max(per_module.values())
    if args.rank > full:
        raise FcpragError(f"--rank {args.rank} exceeds the rank of the exact merge ({full} = the sum of the "
                          f"{len(adapters)} input ranks); expected 1..{full} ({full} is exact: use --mode cat)")


def _cmd_fuse(args: argparse.Namespace) -> int:
    from fcprag_plugin.adapter import LoraAdapter
    from fcprag_plugin.fusion import fuse, warn_repeated_adapters

    if len(args.adapter) != len(args.passage):
        raise FcpragError(f"got {len(args.adapter)} --adapter but {len(args.passage)} --passage; pass one per adapter")
    out = Path(args.out)
    inputs = [("--adapter", a) for a in args.adapter] + [("--controller", c) for c in [args.controller] if c]
    inputs += [("--encoder", e) for e in [args.encoder] if e and Path(e).exists()]
    check_out_dir(out, inputs, args.overwrite)  # before any slow work: refuse early
    warn_repeated_adapters(args.adapter, [f"--adapter {a}" for a in args.adapter])
    query = args.query
    passages = [read_text_arg(p, "--passage") for p in args.passage]
    adapters = [LoraAdapter.from_pretrained(a) for a in args.adapter]
    _check_svd_rank(args, adapters)
    encoder = None
    if args.encoder:
        from fcprag_plugin.encoding import TextEncoder

        encoder = TextEncoder(args.encoder)
    for opt, vals in (("--retrieval-rank", args.retrieval_ranks), ("--retrieval-score", args.retrieval_scores)):
        if vals is not None and len(vals) != len(args.adapter):
            raise FcpragError(f"got {len(vals)} {opt} but {len(args.adapter)} --adapter; pass one per adapter")
    res = fuse(adapters, query, passages, controller=args.controller, encoder=encoder, mode=args.mode,
               retrieval_ranks=args.retrieval_ranks, retrieval_scores=args.retrieval_scores,
               **({"rank": args.rank} if args.rank is not None else {}))
    info = {"query": query, "adapters": [str(a) for a in args.adapter], **res.to_json()}
    if res.mode == "svd":
        info["rank"] = max(res.adapter.ranks.values())  # what was written (a module's exact rank may be lower)

    def fill(tmp: Path) -> None:
        res.adapter.save_pretrained(tmp)
        write_json(tmp / "fusion.json", info)

    write_dir_atomically(out, fill)
    print(f"wrote {out} (mode={res.mode}, controller={res.controller_mode})")
    for a, w in zip(args.adapter, res.merge_weights):
        print(f"  w~={w:.4f}  {a}")
    tau = "-" if res.tau is None else f"{res.tau:.4f}"  # None: uniform weights have no temperature
    print(f"  g={res.g:.4f} tau={tau}" + (f" rank={info['rank']}" if "rank" in info else ""))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from fcprag_plugin.adapter import LoraAdapter

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
    from fcprag_plugin.merge import MERGE_MODES

    p = CliParser(prog="fcprag", description="Learned fusion of per-passage LoRA adapters (PRAG/DyPRAG)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("fuse", help="merge passage adapters with per-query weights into one PEFT adapter directory",
                       description="Compute per-query merge weights for N passage adapters (a controller, or uniform: "
                                   "PRAG's merge) and write the fused adapter to a new PEFT directory --out, with "
                                   "fusion.json (weights, g, tau, mode). --out must not exist yet (or be empty), "
                                   "unless --overwrite; it is never one of the inputs. Written atomically.")
    f.add_argument("--adapter", action="append", required=True, metavar="DIR",
                   help="PEFT adapter directory (repeat, in order)")
    f.add_argument("--passage", action="append", required=True, metavar="TEXT",
                   help="passage text, same order as --adapter (repeat); @FILE reads it from a UTF-8 file")
    f.add_argument("--query", required=True, metavar="TEXT",
                   help="the question (the controller weighs the passages for it)")
    f.add_argument("--controller", metavar="DIR", help="controller directory (default: uniform, PRAG's merge)")
    add_flag(f, "encoder", ENCODER)
    f.add_argument("--retrieval-rank", dest="retrieval_ranks", action="append", type=finite_float, metavar="X",
                   help="retrieval rank of each passage, same order as --adapter (repeat); needed only by a "
                        "controller trained with the retrieval_rank side feature")
    f.add_argument("--retrieval-score", dest="retrieval_scores", action="append", type=finite_float, metavar="X",
                   help="retrieval score of each passage, same order as --adapter (repeat); needed only by a "
                        "controller trained with the retrieval_score side feature")
    f.add_argument("--mode", default="cat", choices=sorted(MERGE_MODES),
                   help="merge mode: cat (exact, default), separate (DyPRAG's), svd (rank-limited cat)")
    f.add_argument("--rank", type=positive_int, metavar="K",
                   help="target rank for --mode svd only (default: the largest input rank; at most the sum of the "
                        "input ranks)")
    f.add_argument("--out", required=True, metavar="DIR",
                   help="output adapter directory (new, or empty; see --overwrite)")
    f.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty --out directory (never an input adapter or the controller)")
    f.set_defaults(func=_cmd_fuse, flag_names=FUSE_FLAGS)

    i = sub.add_parser("inspect", help="print rank, targets, scaling, norms and warnings of adapter directories",
                       description="Print each PEFT adapter directory's rank, target modules, scaling, dtype, "
                                   "update norms and size, and warn about adapters that do nothing.")
    i.add_argument("path", nargs="+", metavar="DIR", help="PEFT adapter directory (one or more)")
    i.add_argument("--per-module", action="store_true", help="also print |A|, |B| and |dW| per module")
    i.set_defaults(func=_cmd_inspect)

    for command in (train_cli, run_cli, labels_cli, study_cli, report_cli):
        command.register(sub)
    return p


def _fail(command: str, message: str) -> int:
    message = " ".join(message.split())  # one line, even when a library below us wrote several
    print(f"fcprag {command}: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    """Run the sub-command; ordinary failures become one line on stderr and exit code 2."""
    cmd = " ".join(x for x in (args.command, getattr(args, "labels_command", None)) if x)
    try:
        return int(args.func(args) or 0)
    except FcpragError as e:  # the library names its keyword arguments; the user typed flags
        return _fail(cmd, keywords_to_flags(e, getattr(args, "flag_names", {})))
    except UnicodeDecodeError as e:  # a file opened by a library below us; the message has no name, say what
        return _fail(cmd, f"an input file is not valid UTF-8 ({e.reason} at byte {e.start})")
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            raise
        where = f"{e.filename}: " if e.filename else ""
        return _fail(cmd, f"{where}{e.strerror or e}")


def _not_utf8(argv: Sequence[str]) -> str | None:
    """One line for the first argument that is not valid UTF-8 (a shell passes raw bytes; Python holds them as
    surrogates, which no text encoder, tokenizer or JSON file takes), naming its option; None when all are."""
    for i, word in enumerate(argv):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as e:
            if word.startswith("--") and "=" in word:
                opt = word.split("=", 1)[0]
            elif i and argv[i - 1].startswith("-"):
                opt = argv[i - 1]
            else:
                opt = f"argument {i + 1}"
            code = ord(word[e.start])
            byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
            words = [w for w in argv[:i] if not w.startswith("-")][:2]
            cmd = " ".join(words[:2] if words[:1] == ["labels"] else words[:1])
            return (f"fcprag{' ' + cmd if cmd else ''}: error: {opt}: the argument is not valid UTF-8 ({byte} at "
                    f"position {e.start}); expected UTF-8 text (texts and paths are written to UTF-8 JSON)")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    bad = _not_utf8(list(sys.argv[1:] if argv is None else argv))
    if bad:
        print(bad, file=sys.stderr)
        return 2
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "accepts_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to print a command that goes on after Ctrl-C
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # the library says each of its warnings in the log too (the line printed above): once is enough here
    warnings.filterwarnings("ignore", message="fcprag: ", category=UserWarning)
    flags = _LogFlags(getattr(args, "flag_names", {}))
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(flags)
    try:
        return _run(args)
    except KeyboardInterrupt:
        hint = getattr(args, "interrupt_hint", None)
        # a callable cleans up after the command and says the whole of what it left
        said = hint() if callable(hint) else "interrupted" + (f"; {hint}" if hint else "")
        print(f"\nfcprag {args.command}: {said}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `fcprag inspect ... | head`): stop quietly, like other Unix tools. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe
    finally:
        for h in handlers:
            h.removeFilter(flags)


class _LogFlags(logging.Filter):
    """The library's log lines name its keyword arguments (``retrieval_ranks=``); on the command line they name
    the command's flags (``--retrieval-rank``), as its error messages do (:func:`keywords_to_flags`)."""

    def __init__(self, flags: dict[str, str]) -> None:
        super().__init__()
        self.flags = flags

    def filter(self, record: logging.LogRecord) -> bool:
        if self.flags and record.name.startswith("fcprag_plugin"):
            said = FcpragError(record.getMessage(), params=[(n, BARE) for n in self.flags if "=" not in n])
            record.msg, record.args = keywords_to_flags(said, self.flags), None
        return True


if __name__ == "__main__":
    sys.exit(main())
