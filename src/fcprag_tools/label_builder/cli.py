"""``fcprag labels {build,from-prag,merge}``: leave-one-out labels for the controller trainer."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..options import ModelPart, Runtime, add_flags, add_model_flags, check_out_file, flag_values, positive_int
from fcprag_plugin.errors import FcpragError, LabelFileError
from ..lm.metrics import SCORINGS


def scale_list(text: str) -> list[float]:
    """argparse type for ``--scales``: comma-separated distinct finite numbers > 0, e.g. ``0.5,1,2``."""
    example = "expected comma-separated distinct numbers > 0, e.g. 0.5,1,2"
    values = []
    for item in text.split(","):
        try:
            v = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}': '{item.strip()}' is not a number; {example}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"'{text}': {item.strip()} is not a finite number > 0; {example}")
        if v in values:
            raise argparse.ArgumentTypeError(f"'{text}': {item.strip()} is given twice; {example}")
        values.append(v)
    return values


def _cmd_build(args: argparse.Namespace) -> int:
    import torch

    from .builder import BuildOptions, LabelBuilder, build_labels, check_scale_grid
    from .manifest import read_manifest
    from ..lm.model_io import check_model_path, load_model, set_threads
    from ..lm.prompts import PromptTemplate
    from ..lm.shard import init_process_group, output_path, part_path, shard_from_env
    from .parts import merge_parts, shard_records
    from ..lm.store import done_ids

    check_out_file("--out", args.out, [("manifest", args.manifest), ("--prompt-template", args.prompt_template)])
    lm, runtime = ModelPart(**flag_values(ModelPart, args)), Runtime(**flag_values(Runtime, args))
    model_path = check_model_path("--model", lm.model)
    tokenizer_path = check_model_path("--tokenizer", args.tokenizer) if args.tokenizer else None
    shard = shard_from_env()
    records = read_manifest(args.manifest)  # every rank validates the whole manifest: a bad line stops all
    template = PromptTemplate.from_file(args.prompt_template) if args.prompt_template else PromptTemplate()
    chat = {"auto": None, "on": True, "off": False}[args.chat_template]
    options = BuildOptions(prompt_mode=args.prompt_mode, template=template, use_chat_template=chat, cot=args.cot,
                           scoring=args.scoring, metric=args.metric, generate=not args.no_generation,
                           max_new_tokens=args.max_new_tokens, empty_generation=(
                               args.empty_generation if args.empty_generation != "auto" else
                               "fail" if args.metric in ("f1", "em") else "zero"),
                           use_slot=args.use_slot, batch_size=args.batch_size, scales=args.scales or (),
                           model_name=lm.model + (f"::{lm.gguf_file}" if lm.gguf_file else ""))
    options.validate()
    set_threads(runtime.threads)
    out = Path(args.out)
    mine = shard_records(records, shard.rank, shard.world)
    target = output_path(out, shard)
    # Records already merged into OUT by an earlier run count as done for every rank.
    skip = set(done_ids(out, repair=False)) if shard.distributed and out.exists() else set()
    for path in dict.fromkeys([target, out]):  # before the model loads: another scale grid is refused at once
        check_scale_grid(path, options.scales)
    args.interrupt_hint = f"{target} keeps every record written so far; the same command resumes after them"
    grouped = init_process_group(shard)
    try:
        model, tok = load_model(model_path, gguf_file=lm.gguf_file, tokenizer=tokenizer_path, dtype=lm.dtype,
                                device=lm.device, local_rank=shard.local_rank, progress=runtime.progress)
        builder = LabelBuilder(model, tok, options)
        desc = f"labels rank {shard.rank}/{shard.world}" if shard.distributed else "labels"
        try:
            summary = build_labels(mine, builder, target, on_error=args.on_error, progress=runtime.progress,
                                   skip_ids=skip, desc=desc, position=shard.rank)
        finally:
            builder.close()
        print(f"{desc}: {summary.written} written, {summary.already_done} already done, {len(summary.failed)} failed "
              f"of {summary.assigned} -> {target} ({summary.records_per_s:.3f} records/s, {summary.seconds:.2f} s)")
        for rid, msg in summary.failed:
            print(f"  failed {rid}: {msg}", file=sys.stderr)
        merged_ok = True
        if grouped:
            import torch.distributed as dist

            dist.barrier()  # every rank has finished its part file
            if shard.rank == 0 and not args.no_merge:
                parts = [part_path(out, r, shard.world) for r in range(shard.world)]
                inputs = ([out] if out.exists() else []) + parts
                try:
                    # a re-run finds its parts already merged into OUT: the same lines twice are fine
                    ms = merge_parts(inputs, records, out, allow_identical_duplicates=True)
                    print(f"merged {ms.written} records from {len(inputs)} files -> {out}")
                except LabelFileError as e:
                    merged_ok = False
                    print(f"not merged into {out}: {e}", file=sys.stderr)
            dist.barrier()  # nobody exits (which makes torchrun stop the others) while rank 0 merges
    finally:
        if grouped and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # Exit 1 when records were skipped (--on-error skip) or the merge failed, so scripts notice.
    return 1 if summary.failed or not merged_ok else 0


def _cmd_from_prag(args: argparse.Namespace) -> int:
    from .manifest import from_prag, write_manifest

    check_out_file("--out", args.out, [("--data-aug", args.data_aug)])
    res = from_prag(args.data_aug, args.adapters_root, id_prefix=args.id_prefix, limit=args.limit)
    if res.missing:
        print(f"{len(res.missing)} adapters missing in {len(res.incomplete_ids)} of {res.total} records:",
              file=sys.stderr)
        for rid, pid, path in res.missing:
            print(f"  {rid} passage {pid}: {path}", file=sys.stderr)
        if args.on_missing == "fail":
            raise FcpragError(f"{len(res.missing)} adapters are missing (listed above); nothing written. Train them, "
                              "narrow with --limit, or pass --on-missing skip to leave those records out")
    n = write_manifest(res.records, args.out)
    skipped = f", {len(res.incomplete_ids)} left out (missing adapters)" if res.incomplete_ids else ""
    print(f"wrote {n} records to {args.out}{skipped}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from .manifest import read_manifest
    from .parts import merge_parts

    check_out_file("--out", args.out, [("--manifest", args.manifest), *(("part", p) for p in args.parts)])
    records = read_manifest(args.manifest)
    s = merge_parts(args.parts, records, args.out, allow_missing=args.allow_missing)
    print(f"merged {s.written} records from {len(args.parts)} files -> {args.out}")
    if s.missing:
        print(f"  {len(s.missing)} manifest ids have no labels (--allow-missing)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from .builder import BuildOptions

    g = sub.add_parser("labels", help="build leave-one-out label files for the controller trainer")
    gs = g.add_subparsers(dest="labels_command", required=True)

    b = gs.add_parser("build", help="evaluate all adapters and each left out, per manifest record",
                      description="Run as a plain process, or under 'torchrun --nproc_per_node=P' / "
                                  "'accelerate launch' to shard the records over processes.")
    b.add_argument("manifest", help="JSON Lines manifest (id, question, answer, passages, adapters)")
    b.add_argument("--out", required=True, help="label file (JSON Lines); resumed if it exists")
    add_model_flags(b, required=True)
    b.add_argument("--tokenizer", help="tokenizer name or path (default: the model's)")
    b.add_argument("--prompt-mode", dest="prompt_mode", default="param", choices=["param", "combine"],
                   help="param: question only; combine: passages also in the context")
    b.add_argument("--prompt-template", dest="prompt_template", help="JSON file overriding prompt texts")
    b.add_argument("--chat-template", dest="chat_template", default="auto", choices=["auto", "on", "off"],
                   help="wrap the prompt in the tokenizer's chat template (auto: when it has one)")
    b.add_argument("--cot", action="store_true", help="chain-of-thought generation; answer after 'the answer is'")
    b.add_argument("--metric", default="answer_logprob", choices=["answer_logprob", "f1", "em"],
                   help="the label metric (metric_all / metric_without); the others are kept as extra fields")
    b.add_argument("--scoring", default="default", choices=SCORINGS,
                   help="how f1/em cut the answer out of a generation; both: stripped, up to the first '.', newline "
                        "or ',', then SQuAD normalisation with the yes/no/noanswer rule. prag: exactly PRAG's "
                        "evaluate (with --cot the marker 'the answer is' must be lower-case); default: the same, "
                        "but the --cot marker in any case")
    b.add_argument("--no-generation", dest="no_generation", action="store_true",
                   help="skip greedy generation (answer_logprob only; much faster)")
    b.add_argument("--max-new-tokens", dest="max_new_tokens", type=positive_int, default=BuildOptions.max_new_tokens,
                   help="greedy generation length (default %(default)s, longer than fcprag study's: room for --cot's "
                        "reasoning before 'the answer is'; a short answer ends at its first '.', ',' or newline)")
    b.add_argument("--on-error", dest="on_error", default="fail", choices=["fail", "skip"],
                   help="a record that fails (adapter does not load, empty generation): stop, or log and skip it")
    b.add_argument("--empty-generation", dest="empty_generation", default="auto", choices=["auto", "fail", "zero"],
                   help="an empty answer is a record error (fail) or scores f1 = em = 0, counted in the record's "
                        "empty_generations (zero); auto (default): fail when --metric is f1 or em (the label itself "
                        "would be made up), else zero (the label metric does not read the generation)")
    b.add_argument("--use-slot", dest="use_slot", action="store_true",
                   help="evaluate subsets in one pre-allocated fused slot (fcprag_plugin.slot.FusedSlot) instead of "
                        "a merged adapter + hooks per subset")
    b.add_argument("--batch-size", dest="batch_size", type=positive_int, default=16,
                   help="rows (subsets x gold aliases) per batched forward, each with its own adapter mixture; the "
                        "subsets of several records share a forward. 1: one subset at a time (the sequential path)")
    b.add_argument("--scales", type=scale_list, metavar="S[,S...]",
                   help="also measure the full set merged with every w~_i = s, for each total scale s (e.g. "
                        "0.5,1,2,4): fields scales, metric_at_scales, <metric>_at_scales; s = 1 reuses metric_all; "
                        "one extra evaluation per record and scale != 1")
    b.add_argument("--no-merge", dest="no_merge", action="store_true",
                   help="under torchrun: leave the part files, do not merge them into --out at the end")
    add_flags(b, Runtime)
    b.set_defaults(func=_cmd_build)

    p = gs.add_parser("from-prag", help="write a manifest from PRAG's augmented data and adapter tree", description=(
        "Write a labels-build manifest (one record per question: id, question, answer, passages, adapters) from PRAG's "
        "augmented data file (a JSON array or JSON Lines) and its data_{test_id}/passage_{pid} adapter tree. Missing "
        "adapters are listed."))
    p.add_argument("--data-aug", dest="data_aug", required=True, help="PRAG augmented data file (JSON array or JSONL)")
    p.add_argument("--adapters-root", dest="adapters_root", required=True,
                   help="folder holding data_{test_id}/passage_{pid} adapter directories")
    p.add_argument("--out", required=True, help="manifest to write (JSON Lines)")
    p.add_argument("--id-prefix", dest="id_prefix", help="record id prefix (default: '<data file stem>-')")
    p.add_argument("--limit", type=positive_int, help="only the first N records (PRAG's --sample)")
    p.add_argument("--on-missing", dest="on_missing", default="fail", choices=["fail", "skip"],
                   help="records with missing adapters: fail (write nothing) or leave them out; always listed")
    p.set_defaults(func=_cmd_from_prag)

    m = gs.add_parser("merge", help="validate part files against the manifest and concatenate in manifest order",
                      description="Merge the part files of a sharded 'labels build' (run with --no-merge, or "
                                  "interrupted) into one label file in manifest order; every record is checked "
                                  "against the manifest.")
    m.add_argument("parts", nargs="+", help="label part files (labels build writes OUT's stem + "
                                            ".part{r}-of{P}.jsonl, e.g. labels.part*-of*.jsonl)")
    m.add_argument("--manifest", required=True, help="the manifest the parts were built from (JSON Lines)")
    m.add_argument("--out", required=True, help="merged label file to write (JSON Lines, manifest order)")
    m.add_argument("--allow-missing", dest="allow_missing", action="store_true",
                   help="write what is there even if some manifest ids have no labels")
    m.set_defaults(func=_cmd_merge)
