"""``fcprag report DIR``: rebuild a study folder's ``summary.json``, ``report.md`` and ``report.png`` from its rows,
without a model, in seconds (other margins, target effects or a newer rule on the same measurements).

It reads ``settings.json``, ``questions.jsonl`` and ``eval.jsonl`` (each also as ``.jsonl.gz``), and per setting the
controller's kappa and cross-validation: ``train/learned{,_combine}/config.json`` (a given controller's
``config.json``), else the ``summary.json`` already there (its ``training_verdict`` and ``kappa_learned``). Where
DyPRAG's rows were scored, its section is read from the folder's DyPRAG files too (:func:`.dyprag.dyprag_record`:
``translator/translator.json``, the generation seconds and cosines, ``adapters.jsonl``, ``timings.jsonl``). When the
trained controller is there, ``controller{,_combine}/`` is rewritten to what ships now.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_if_present, read_records
from ..options import finite_float
from . import summary
from .options import Policy
from .verdict.records import SETTINGS, ControllerRecord, ScoredRows, suffix

logger = logging.getLogger(__name__)


def read_rows(folder: Path, name: str) -> dict[str, dict[str, Any]]:
    """``{id: row}`` of ``name.jsonl`` or ``name.jsonl.gz`` (the last row of an id wins, as the study's stores)."""
    for path in (folder / f"{name}.jsonl", folder / f"{name}.jsonl.gz"):
        if path.is_file():
            out: dict[str, dict[str, Any]] = {}
            for n, r in read_records(path, FcpragError):
                if not isinstance(r, dict) or not isinstance(r.get("id"), str):
                    raise FcpragError(f"{path}:{n}: expected a JSON object with a string 'id'")
                out[r["id"]] = r
            return out
    raise FcpragError(f"{folder}: no {name}.jsonl (or {name}.jsonl.gz); expected a study folder (fcprag study --out)")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return read_json_if_present(path, ValueError)
    except ValueError:
        return None


def controller_of(folder: Path, setting: str, settings: dict[str, Any], old: dict[str, Any] | None
                  ) -> tuple[ControllerRecord, Path | None]:
    """``(what the verdict reads of the controller, the trained controller's folder or None)``: from its
    ``config.json`` (and the trainer's recorded arguments), else from the ``summary.json`` already there."""
    from fcprag_plugin.training import ARGS_NAME

    learned = folder / "train" / ("learned" + suffix(setting))
    where = Path(settings["controller"]) if settings.get("controller") else learned
    cfg = _json(where / "config.json")
    if cfg is not None and isinstance(cfg.get("kappa"), (int, float)):
        kappa, cv = float(cfg["kappa"]), cfg.get("cv") or {}
    else:
        sv = (((old or {}).get("verdict") or {}).get("settings") or {}).get(setting)
        if not isinstance(sv, dict) or not isinstance(sv.get("kappa_learned"), (int, float)):
            raise FcpragError(f"{folder}: no controller config ({where / 'config.json'}) and no summary.json verdict "
                              f"for setting '{setting}'; expected a study folder with its train/ or its summary.json")
        kappa = float(sv["kappa_learned"])
        cv = {k: v for k, v in (((old or {}).get("training_verdict") or {}).get(setting) or {}).items()
              if k != "note"}
    args = None if settings.get("controller") else _json(learned / ARGS_NAME)
    record = ControllerRecord(kappa, cv, args, summary.scale_labels(folder, setting))
    return record, learned if cfg is not None and not settings.get("controller") else None


def rebuild(folder: str | Path, policy: Policy) -> dict[str, Any]:
    """Rebuild ``summary.json``, ``report.md`` and ``report.png`` of study folder ``folder`` (returns the summary;
    its ``shared_rows`` counted from ``eval.jsonl``'s copies as the study's own summary counts them)."""
    from .stages.verdict import shared_rows

    folder = Path(folder)
    if not folder.is_dir():
        raise FcpragError(f"DIR {folder}: not a folder; expected a study folder (fcprag study --out)")
    settings = _json(folder / "settings.json")
    if settings is None or "questions_sha256" not in settings:
        raise FcpragError(f"DIR {folder}: no study settings.json there; expected a study folder (fcprag study --out)")
    old = _json(folder / "summary.json")
    qs = {q: r for q, r in read_rows(folder, "questions").items() if r.get("split") in ("train", "test")}
    scored = read_rows(folder, "eval")
    rows = ScoredRows.from_dicts(qs, scored)
    if not rows.test or not any(rows.has(q, "prag_sum") for q in rows.test):
        raise FcpragError(f"DIR {folder}: eval rows of no held-out question; run fcprag study to evaluate first")
    given = bool(settings.get("controller"))
    found = {s: controller_of(folder, s, settings, old) for s in SETTINGS}
    ctrls = {s: c for s, (c, _) in found.items()}
    kept = (old or {}).get("settings") or {}
    full = {**kept, **settings, "out": str(folder), "device": kept.get("device", "not recorded"),
            "dtype": kept.get("dtype", settings.get("dtype", "not recorded")), "controller_trained": not given}
    try:  # a re-report runs no stage: its stage times are the study's (timings.jsonl), none of this invocation
        out = summary.finish(rows, ctrls, given=given, settings=full, out=folder, policy=policy, stage_seconds={},
                             shared=shared_rows(scored))  # the copies counted as the study counts them
    except FcpragError as e:  # the rows of an unfinished study: not every row the summary needs is there
        raise FcpragError(f"DIR {folder}: its rows do not make a complete summary: {e}; run its fcprag study "
                          "command again to finish it") from None
    for s, (_, learned) in found.items():
        if learned is not None:
            save_shipped(folder, s, out["verdict"]["settings"][s], learned, qs)
    return out


def save_shipped(folder: Path, setting: str, verdict: dict[str, Any], learned: Path, qs: dict[str, Any]) -> None:
    """``controller{,_combine}/``: what ships now, from the trained controller in ``learned``
    (:func:`.stages.verdict.save_controller`, with the training question ids of ``qs``)."""
    from fcprag_plugin import FusionController
    from .stages.verdict import save_controller

    trained = FusionController.from_pretrained(learned).eval()
    save_controller(folder, setting, summary.controller_for(verdict["ship"], verdict["kappa"], trained), qs)


def _cmd_report(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = rebuild(args.dir, policy_of(args))
    shipped = ", ".join(f"{k} {v['ship']}" for k, v in s["verdict"]["settings"].items())
    w = s["verdict"]["what_to_run"]
    print(f"wrote {args.dir}/summary.json, report.md and report.png in {time.perf_counter() - t0:.1f} s; ships: "
          f"{shipped}; what to run: {w['row'] if w else 'not decided (no F1)'}")
    return 0


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    """``--min-gain``, ``--min-scale-gain`` and ``--target-f1`` (shared by ``fcprag study`` and ``fcprag report``)."""
    p.add_argument("--min-gain", type=finite_float, default=Policy.min_gain, metavar="NATS",
                   help="the smallest reweighting gain worth shipping a network for, in gold log-lik. per question: "
                        "its cross-validated lower bound must lie above it (default: %(default)s)")
    p.add_argument("--min-scale-gain", type=finite_float, metavar="NATS",
                   help="the same for a scale over PRAG's sum (default: --min-gain)")
    p.add_argument("--target-f1", type=finite_float, default=Policy.target_f1, metavar="FRACTION",
                   help="the F1 difference the power figures are sized for, a fraction of 1 as F1 in summary.json "
                        "(0.03 = 3 points); inside +-it a held-out comparison is 'equivalent' (default: %(default)s)")


def policy_of(args: argparse.Namespace) -> Policy:
    """The :class:`Policy` the flags of :func:`add_policy_flags` give (one line naming the flag on a mistake)."""
    return Policy.checked(min_gain=args.min_gain, min_scale_gain=args.min_scale_gain, target_f1=args.target_f1)


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="rebuild a study folder's summary.json, report.md and plot from its rows (no "
                                      "model, seconds)",
                       description="Rebuild DIR/summary.json, report.md and report.png from a study folder's "
                                   "questions.jsonl and eval.jsonl (or .jsonl.gz) and its controllers' "
                                   "cross-validation, with other margins or target effects; no model is loaded. "
                                   "Where DIR keeps the trained controllers (train/learned{,_combine}/), it also "
                                   "rewrites controller/ and controller_combine/ to what ships now.")
    r.add_argument("dir", metavar="DIR", help="a study folder (fcprag study --out)")
    add_policy_flags(r)
    r.set_defaults(func=_cmd_report)
