"""The study's result from the scored rows and each setting's controller: ``summary.json`` (fields checked by
:func:`.verdict.schema.check_summary`), ``report.md`` (every figure read from the summary) and ``report.png``.

Two settings, each with its own controller: ``param`` (PRAG's prompt, the question only) and ``combine`` (the
passages in the prompt too, the paper's "Combine"); a row's Combine twin carries the suffix ``_combine``. What ships
in each is decided on the training questions (:mod:`.verdict.ship`), what to run is chosen on them
(:mod:`.verdict.choice`), and the held-out questions measure both. The arithmetic is :mod:`.verdict` (pure
functions on :class:`.verdict.records.ScoredRows`); this module puts its results together and writes the files.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Mapping

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import write_atomic, write_json
from .dyprag import dyprag_record, is_dyprag
from .options import Policy, study_training
from .verdict.choice import candidates, choice_left_out, what_to_run
from .verdict.coverage import coverage, needed_rows
from .verdict.dyprag_section import dyprag_section
from .verdict.markdown import report
from .verdict.words import follow_text, plain, plain_held_out
from .verdict.plot import write_plot
from .verdict.records import SETTINGS, ControllerRecord, ScaleLabel, ScoredRows, SettingVerdict, suffix
from .verdict.schema import check_summary
from .verdict.ship import rule_starved, setting_verdict
from .verdict.tables import CANDIDATES, ceiling_info, datasets_of, figures, paired_table, partial_rows, row_names, \
    split_info

# what the study's other rooms import from here
__all__ = ["CANDIDATES", "SETTINGS", "build", "check_summary", "finish", "rule_starved", "scale_labels",
           "setting_verdict", "shipped_controller", "suffix", "verdicts", "controller_for"]

logger = logging.getLogger(__name__)
F1_UNIT = "fraction"  # F1 in summary.json and --target-f1: a fraction of 1 (0.03 = 3 points), as PRAG's scorer


def trainer_defaults() -> dict[str, Any]:
    """The arguments the study's trainer runs with (:func:`.options.study_training`), for a folder that does not keep
    its own."""
    return asdict(study_training())


def scale_labels(folder: Path, setting: str) -> tuple[ScaleLabel, ...] | None:
    """The measured scale labels of ``setting``'s label file in ``folder`` (``labels{,_combine}.jsonl``, or
    ``.jsonl.gz``); None when the folder does not keep it or it cannot be read (said in a warning)."""
    from fcprag_plugin.training import load_labels

    name = "labels" + suffix(setting)
    path = next((p for p in (folder / f"{name}.jsonl", folder / f"{name}.jsonl.gz") if p.is_file()), None)
    if path is None:
        return None
    try:
        records = load_labels(path, on_error="skip")
    except FcpragError as e:
        logger.warning("%s: not read (%s); the risk rule's figures are left out", path, e)
        return None
    return tuple(ScaleLabel(r.group_key, r.scale_gains, r.f1_scale_gains) for r in records if r.scale_gains)


def verdicts(rows: ScoredRows, ctrls: Mapping[str, ControllerRecord], *, given: bool, policy: Policy
             ) -> dict[str, SettingVerdict]:
    """Each setting's verdict (``given``: ``--controller``) under ``policy``."""
    defaults = trainer_defaults()
    return {s: setting_verdict(rows, s, ctrls[s], given=given, policy=policy, default_args=defaults)
            for s in SETTINGS}


def shipped_controller(verdict: SettingVerdict, ctrl: Any) -> Any:
    """The controller of what ships (:func:`controller_for` the verdict's ``ship`` and ``kappa``)."""
    return controller_for(verdict.ship, verdict.kappa, ctrl)


def controller_for(ship: str, kappa: float, ctrl: Any) -> Any:
    """``ctrl`` itself when its network ships, else the scale-only controller at ``kappa`` (the trained one's recipe
    recorded: its check warns on other adapters)."""
    from fcprag_plugin import FusionController

    cfg = ctrl.config
    if ship == "network":
        return ctrl
    shipped = FusionController.scale_only(kappa, embed_dim=cfg.embed_dim, embedding_model=cfg.embedding_model)
    shipped.config.trained_for = cfg.trained_for
    return shipped.eval()


def _choices(rows: ScoredRows, keys: list[str], verdicts_: Mapping[str, SettingVerdict], given: bool,
             policy: Policy) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """What to run overall and per dataset, as ``summary.json`` records it (with its sentences)."""
    overall, by_dataset = what_to_run(rows, keys, descriptive=given, cands=candidates(verdicts_, rows), policy=policy)

    def as_json(c: Any, d: str | None, top: dict[str, Any] | None) -> dict[str, Any]:
        j = c.to_json()
        return {**j, "plain": plain(j, d), "plain_held_out": plain_held_out(j),
                **({"plain_follow": follow_text(j, d, top)} if d and top and j.get("vs_overall") else {})}

    top = None if overall is None else as_json(overall, None, None)
    return top, {d: as_json(c, d, top) for d, c in by_dataset.items()}


def _training_verdict(ctrls: Mapping[str, ControllerRecord]) -> dict[str, Any] | None:
    """The trainer's own cross-validation per setting (``shipped`` there is what the trainer kept: the study keeps
    the network to measure it; what ships is ``verdict.settings``)."""
    note = ("first order, from the training labels (fcprag train's cross-validation); what ships is decided on it "
            "(verdict.settings); trainer_kept: what the trainer kept, the network, for the study to measure it")
    out = {s: {"note": note, **{k: v for k, v in c.cv.items() if k not in ("shipped", "trainer_kept", "note")},
               "trainer_kept": c.cv.get("shipped", c.cv.get("trainer_kept"))} for s, c in ctrls.items() if c.cv}
    return out or None


def build(rows: ScoredRows, ctrls: Mapping[str, ControllerRecord], *, given: bool, settings: dict[str, Any],
          stage_seconds: dict[str, float], policy: Policy, shared: dict[str, dict[str, int]] | None = None,
          dyprag: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``'s content (no I/O): each setting's verdict and what to run over the held-out questions
    with every row the summary needs (the others left out, and said: ``left_out``). ``shared``: the rows scored once
    for another (``{row: {the row it shares: questions}}``); ``dyprag``: the folder's DyPRAG record
    (:func:`.dyprag.dyprag_record`), read into the ``dyprag`` section where DyPRAG's rows are in the table (a study
    without them has no such key)."""
    keys, left = coverage(rows, needed_rows(rows, ctrls))
    rows = replace(rows, scores={k: v for k, v in rows.scores.items() if k[0] in set(keys) or
                                 rows.questions[k[0]].split != "test"})
    verdicts_ = verdicts(rows, ctrls, given=given, policy=policy)
    rows = rows.with_copies({f"recommended{suffix(s)}": v.recommended_row for s, v in verdicts_.items()})
    names = row_names(rows, keys)
    methods = {n: figures(rows, keys, n).to_json() for n in names}
    overall, by_dataset = _choices(rows, keys, verdicts_, given, policy)
    param = verdicts_["param"].to_json()
    pairs = paired_table(rows, keys, names, policy)
    second = dyprag_section(rows, keys, names, pairs, verdicts_, dyprag, policy)  # DyPRAG, the second host
    return {
        "n_train": len(rows.train), "n_test": len(keys), "f1_unit": F1_UNIT, "settings": settings,
        "split": split_info(rows, settings).to_json(),
        "policy": policy.record(),
        "datasets": datasets_of(rows, keys),
        "left_out": {"held_out": left, "choice": choice_left_out(rows, keys, candidates(verdicts_, rows), given),
                     "rows_not_in_table": partial_rows(rows, keys)},
        "methods": methods, "paired": {n: p.to_json() for n, p in pairs.items()},
        "verdict": {**{k: param[k] for k in ("ship", "kappa", "kappa_learned", "decided_on", "margins", "cv", "scale",
                                             "reweighting", "why", "recommended_row")},
                    "settings": {s: v.to_json() for s, v in verdicts_.items()}, "what_to_run": overall,
                    "what_to_run_by_dataset": by_dataset},
        "ceiling": ceiling_info(rows, keys, pairs, verdicts_).to_json(),
        **({} if second is None else {"dyprag": second.to_json()}),
        "training_verdict": _training_verdict(ctrls),
        "stage_seconds": stage_seconds, "shared_rows": shared or {},
    }


def finish(rows: ScoredRows, ctrls: Mapping[str, ControllerRecord], *, given: bool, settings: dict[str, Any],
           stage_seconds: dict[str, float], out: Path, policy: Policy,
           shared: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """:func:`build` (with the DyPRAG record of the folder ``out`` where DyPRAG's rows were scored), checked, then
    ``summary.json``, ``report.md`` and ``report.png`` (when matplotlib is there) written to ``out``; returns the
    summary. Rows that cannot make a summary are one :class:`FcpragError` line."""
    record = dyprag_record(out) if any(is_dyprag(name) for _, name in rows.scores) else None
    summary = build(rows, ctrls, given=given, settings=settings, stage_seconds=stage_seconds, policy=policy,
                    shared=shared, dyprag=record)
    problems = check_summary(summary)
    if problems:
        raise FcpragError(f"summary.json would be incomplete ({len(problems)} problems): " + "; ".join(problems)[:300])
    write_json(out / "summary.json", summary)
    plot = write_plot(summary, out / "report.png")
    write_atomic(out / "report.md", report(summary, plot))
    return summary
