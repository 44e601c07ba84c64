"""The study's result from the scored rows and each setting's controller: ``summary.json`` (fields checked by
:func:`.verdict.schema.check_summary`), ``report.md`` (every figure read from the summary) and ``report.png``.

Two settings, each with its own controller: ``param`` (PRAG's prompt, the question only) and ``combine`` (the
passages in the prompt too, the paper's "Combine"); a row's Combine twin carries the suffix ``_combine``. What ships
in each is decided on the training questions (:mod:`.verdict.ship`), what to run is chosen on them
(:mod:`.verdict.choice`), and the held-out questions measure both. The arithmetic is :mod:`.verdict` (pure
functions on :class:`.verdict.records.ScoredRows`); this module puts its results together and writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fcprag_plugin.fileio import write_atomic, write_json
from .options import Policy
from .verdict.choice import candidates, what_to_run
from .verdict.markdown import plain, report
from .verdict.plot import write_plot
from .verdict.records import SETTINGS, ControllerRecord, ScoredRows, SettingVerdict, suffix
from .verdict.schema import check_summary
from .verdict.ship import rule_starved, setting_verdict
from .verdict.tables import CANDIDATES, breakdown, ceiling_info, datasets_of, metric_means, paired_table, row_names, \
    split_info

# what the study's other rooms import from here
__all__ = ["CANDIDATES", "SETTINGS", "build", "check_summary", "finish", "rule_starved", "setting_verdict",
           "shipped_controller", "suffix", "verdicts"]


def verdicts(rows: ScoredRows, ctrls: Mapping[str, ControllerRecord], *, given: bool, policy: Policy
             ) -> dict[str, SettingVerdict]:
    """Each setting's verdict (``given``: ``--controller``) under ``policy``."""
    return {s: setting_verdict(rows, s, ctrls[s], given=given, policy=policy) for s in SETTINGS}


def shipped_controller(verdict: SettingVerdict, ctrl: Any) -> Any:
    """The controller of what ships (the trained one's recipe recorded: its check warns on other adapters)."""
    from fcprag_plugin import FusionController

    cfg = ctrl.config
    if verdict.ship == "network":
        return ctrl
    shipped = FusionController.scale_only(verdict.kappa, embed_dim=cfg.embed_dim, embedding_model=cfg.embedding_model)
    shipped.config.trained_for = cfg.trained_for
    return shipped.eval()


def _choices(rows: ScoredRows, keys: list[str], verdicts_: Mapping[str, SettingVerdict], given: bool,
             policy: Policy) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """What to run overall and per dataset, as ``summary.json`` records it (with its sentence, ``plain``)."""
    overall, by_dataset = what_to_run(rows, keys, descriptive=given, cands=candidates(verdicts_), policy=policy)
    as_json = lambda c, d: {**c.to_json(), "plain": plain(c.to_json(), d)}  # noqa: E731
    return (None if overall is None else as_json(overall, None)), {d: as_json(c, d) for d, c in by_dataset.items()}


def build(rows: ScoredRows, verdicts_: Mapping[str, SettingVerdict], ctrls: Mapping[str, ControllerRecord], *,
          given: bool, settings: dict[str, Any], stage_seconds: dict[str, float], policy: Policy,
          shared: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """``summary.json``'s content (no I/O). ``shared``: the rows scored once for another (``{row: {the row it
    shares: questions}}``)."""
    rows = rows.with_copies({f"recommended{suffix(s)}": v.recommended_row for s, v in verdicts_.items()})
    test = rows.test
    names = row_names(rows, test)
    keys = rows.complete(test, names)
    methods = {}
    for n in names:
        by_dataset, by_subtask = breakdown(rows, keys, n)
        methods[n] = {**metric_means(rows, keys, n), "by_dataset": by_dataset, "by_subtask": by_subtask}
    overall, by_dataset = _choices(rows, keys, verdicts_, given, policy)
    param = verdicts_["param"].to_json()
    pairs = paired_table(rows, keys, names, policy)
    return {
        "n_train": len(rows.train), "n_test": len(keys), "settings": settings,
        "split": split_info(rows, settings),
        "policy": policy.record(),
        "datasets": datasets_of(rows, keys),
        "methods": methods, "paired": pairs,
        "verdict": {**{k: param[k] for k in ("ship", "kappa", "kappa_learned", "decided_on", "margins", "cv", "scale",
                                             "reweighting", "why", "recommended_row")},
                    "settings": {s: v.to_json() for s, v in verdicts_.items()}, "what_to_run": overall,
                    "what_to_run_by_dataset": by_dataset},
        "ceiling": ceiling_info(rows, keys, pairs, verdicts_),
        "training_verdict": {s: {"note": "first order, from the training labels (fcprag train's cross-validation); "
                                         "what ships is decided on it", **c.cv} for s, c in ctrls.items() if c.cv}
        or None,
        "stage_seconds": stage_seconds, "shared_rows": shared or {},
    }


def finish(rows: ScoredRows, verdicts_: Mapping[str, SettingVerdict], ctrls: Mapping[str, ControllerRecord], *,
           given: bool, settings: dict[str, Any], stage_seconds: dict[str, float], out: Path, policy: Policy,
           shared: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """:func:`build`, checked, then ``summary.json``, ``report.md`` and ``report.png`` (when matplotlib is there)
    written to ``out``; returns the summary."""
    summary = build(rows, verdicts_, ctrls, given=given, settings=settings, stage_seconds=stage_seconds,
                    policy=policy, shared=shared)
    problems = check_summary(summary)
    if problems:
        raise RuntimeError(f"summary.json would be incomplete: {problems}")
    write_json(out / "summary.json", summary)
    plot = write_plot(summary, out / "report.png")
    write_atomic(out / "report.md", report(summary, plot))
    return summary
