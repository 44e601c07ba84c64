"""``fcprag run {prag,dyprag} [options] -- SCRIPT ARGS...``: run an unmodified host script with a shim installed."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from fcprag_plugin.errors import FcpragError

from .launch import LAUNCHERS
from .options import ENCODER, add_flag, int_at_least

# passages per question a slot is sized for at most (a slot holds max_adapters x rank factors per module: 1024 of
# rank 2 on an 8B Llama are about 7 GB): a larger --slot-max-adapters is refused before anything is allocated
MAX_SLOT_ADAPTERS = 1024

QUIET_FUTURE_WARNINGS = ("transformers", "peft")  # packages whose FutureWarnings are ignored while the script runs
# the shims' install() / fcprag_tools.launch keyword arguments -> `fcprag run`'s flags, for their messages
RUN_FLAGS = {
    "controller": "--controller",
    "encoder": "--encoder",
    "mode": "--mode",
    "log": "--log",
    "data_file": "--data-file",
    "use_slot=True": "--use-slot",
    "max_adapters": "--slot-max-adapters",
    "slot_max_adapters": "--slot-max-adapters",
}


def _cmd_run(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise FcpragError(f"give the host script after '--', e.g. fcprag run {args.host} --controller DIR -- "
                          "src/inference.py ARGS...")
    if not Path(rest[0]).is_file():
        raise FcpragError(f"host script {rest[0]} not found; expected the path of PRAG's / DyPRAG's inference script "
                          "after '--'")
    options = {k: v for k, v in vars(args).items()
               if k in {"controller", "encoder", "mode", "log", "data_file", "use_slot", "slot_max_adapters"}
               and v is not None}
    with warnings.catch_warnings():
        # transformers' and peft's deprecation notices (FutureWarning) are about how the unmodified host script calls
        # them: nothing its user can act on. Only those, only while it runs; every other warning stays.
        for module in QUIET_FUTURE_WARNINGS:
            warnings.filterwarnings("ignore", category=FutureWarning, module=rf"{module}(\.|$)")
        return int(LAUNCHERS[args.host](rest[0], rest[1:], **options) or 0)


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run PRAG's or DyPRAG's unmodified inference script with learned fusion",
                       usage="fcprag run {dyprag,prag} [options] -- SCRIPT [ARGS ...]",
                       description="Everything after '--' is the host script and its own arguments.")
    r.add_argument("host", choices=sorted(LAUNCHERS), help="which host's merge to replace: prag or dyprag")
    r.add_argument("--controller", help="controller directory (omit for the uniform baseline)")
    add_flag(r, "encoder", ENCODER)
    r.add_argument("--mode",
                   help="merge mode: prag: cat (default) | separate | svd; dyprag: separate (default) | cat (on DyPRAG's "
                        "weights w~/N: the exact weighted mean of the updates)")
    r.add_argument("--log", help="per-question JSON Lines log")
    r.add_argument("--data-file", dest="data_file",
                   help="prag: PRAG's augmented data file, to map adapter paths back to questions")
    r.add_argument("--use-slot", dest="use_slot", action="store_const", const=True,
                   help="merge into a pre-allocated fused slot (fcprag_plugin.slot): prag builds no merged PEFT "
                        "modules, dyprag builds no dense deltas (prag modes cat/separate)")
    r.add_argument("--slot-max-adapters", dest="slot_max_adapters", type=int_at_least(1, MAX_SLOT_ADAPTERS),
                   help="with --use-slot: fixed slot capacity (most passages per question); default: grow as needed")
    r.set_defaults(func=_cmd_run, accepts_rest=True, flag_names=RUN_FLAGS)
