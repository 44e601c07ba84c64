"""The evaluation stage: the rows of each question by real forwards in mixed batches (``eval.jsonl``, a row a
question and row name); a row already there with the same passages, prompt and ``w~`` is not scored again, and a
row whose passages, prompt and ``w~`` equal another row's of its question to the last bit is scored once: its
record is that row's, under its own name, with ``"shared_with"`` naming the row scored (:func:`share`).

A DyPRAG row (:func:`..dyprag.is_dyprag`) is scored through its one composite update (``scoring.Row.update``, from
the :class:`.translator.DypragSource`), records the translator's identity and is valid for that translator only;
it shares only with a DyPRAG row of the same translator and ``w~``, never with a PRAG row."""

from __future__ import annotations

import time
from typing import Any

from ...progress import moves_inside
from .. import adapters as ad
from .. import scoring
from ..dyprag import COSINE, GENERATED, is_dyprag
from ..options import Batching, Generation
from ..run import StudyRun
from .retrieval import Questions
from .rows import Rows, oracle as oracle_weights

W_TOL = 1e-5
Scored = dict[str, dict[str, Any]]  # {"qid|row": the row of eval.jsonl}


def _identity(dyprag: Any, name: str) -> str | None:
    """The translator identity row ``name`` must record (None: a row without one)."""
    return dyprag.sha256 if dyprag is not None and is_dyprag(name) else None


def _valid(qs: Questions, done: Scored, qid: str, name: str, spec: tuple[str, list[float]] | None,
           translator: str | None = None) -> bool:
    """``eval.jsonl`` holds row ``name`` of ``qid`` for the same passages and ``translator`` (and, given ``spec``,
    the same prompt and ``w~`` within :data:`W_TOL`)."""
    r = done.get(f"{qid}|{name}")
    if r is None or r.get("pids") != [p["pid"] for p in qs[qid]["passages"]] or r.get("translator") != translator:
        return False
    if spec is None:
        return True
    prompt, w = spec
    return (r.get("prompt", "param") == prompt and r.get("w") is not None and len(r["w"]) == len(w)
            and all(abs(a - b) <= W_TOL for a, b in zip(r["w"], w)))


def _key(qid: str, prompt: str, pids: list[str], w: list[float], translator: str | None) -> tuple[Any, ...]:
    return qid, prompt, tuple(pids), tuple(float(x) for x in w), translator


def share(rows: list[scoring.Row], done: Scored) -> tuple[list[scoring.Row], list[tuple[scoring.Row, str]]]:
    """``(rows to score, [(row, the row it shares)])``: a row equal (question, passages, prompt, ``w~``, bit for
    bit, and the update: PRAG's adapters, or the same translator's) to an earlier row of ``rows`` or to a scored row
    of ``done`` is not scored. A recorded ``w~`` is rounded to 6 digits, so a row matches a recorded one only when
    its own ``w~`` is that rounding exactly."""
    recorded: dict[tuple[Any, ...], str] = {}
    for rid, r in done.items():  # a copy is never an origin: its origin is
        if r.get("w") is not None and "shared_with" not in r:
            qid, name = rid.split("|", 1)
            recorded.setdefault(_key(qid, r.get("prompt", "param"), r["pids"], r["w"], r.get("translator")), name)
    now: dict[tuple[Any, ...], str] = {}
    todo, copies = [], []
    for row in rows:
        key = _key(row.qid, row.prompt, row.pids, row.weights, row.translator)
        origin = now.get(key) or (recorded.get(key) if all(round(x, 6) == x for x in key[3]) else None)
        if origin is not None and origin != row.name:
            copies.append((row, origin))
        else:
            now.setdefault(key, row.name)
            todo.append(row)
    return todo, copies


def _copy(done: Scored, row: scoring.Row, origin: str) -> dict[str, Any]:
    """Row ``row``'s record: ``origin``'s (scored), under ``row``'s name."""
    return {**done[f"{row.qid}|{origin}"], "id": f"{row.qid}|{row.name}", "shared_with": origin}


def _updates(dyprag: Any, rows: list[scoring.Row]) -> None:
    """Each DyPRAG row of ``rows`` gets its composite update (its questions' passages generated in one call); rows
    of the same passages and ``w~`` (``dyprag`` and ``dyprag_combine``) get the same one: one slot entry."""
    mine = [r for r in rows if r.translator is not None]
    if mine:
        dyprag.prepare(list(dict.fromkeys(r.qid for r in mine)))
    made: dict[tuple[Any, ...], Any] = {}
    for r in mine:
        key = (tuple(r.pids), tuple(r.weights))
        if key not in made:
            made[key] = dyprag.composite(r.pids, r.weights)
        r.update = made[key]


def _score_chunk(run: StudyRun, qs: Questions, want: dict[str, Rows], chunk: list[str], done: Scored, oracle: bool,
                 bar: Any, gen: Generation, batch_size: int | None, dyprag: Any = None) -> None:
    """Score ``chunk``'s rows that are not valid in ``done`` (then its oracle rows) in one fused slot, appending
    them to ``eval.jsonl`` and ``done``; ``bar`` moves after every forward. ``dyprag``: the DyPRAG rows' source."""
    from fcprag_plugin.slot import FusedSlot

    st = run.store("eval")
    pids = [p["pid"] for qid in chunk for p in qs[qid]["passages"]]
    # a DyPRAG row's update has its translator's rank, which need not be PRAG's
    rank = max(ad.LORA["r"], dyprag.rank if dyprag is not None else 0)
    slot = FusedSlot.for_model(run.model, run.adapter(pids[0]), max_adapters=len(pids), max_rank=rank)
    rows = [scoring.Row(qid, n, [p["pid"] for p in qs[qid]["passages"]], w, prompt,
                        translator=_identity(dyprag, n))
            for qid in chunk for n, (prompt, w) in want[qid].items()
            if not _valid(qs, done, qid, n, (prompt, w), _identity(dyprag, n))]
    # the bar moves after every forward: a share of a call is that share of its rows
    step, finish = moves_inside(bar, len(chunk), len(rows) + (len(chunk) if oracle else 0))

    def score(rows: list[scoring.Row]) -> None:
        part, copies = share(rows, done)
        _updates(dyprag, part)
        res = scoring.score(run.model, run.tok, slot, part, qs, run.adapter, generate=gen.generate,
                            max_new_tokens=gen.max_new_tokens, batch_size=run.batch_size(batch_size),
                            on_progress=lambda k: step(k * len(part))) if part else []
        done.update({r["id"]: r for r in res})
        copied = [_copy(done, row, origin) for row, origin in copies]
        done.update({r["id"]: r for r in copied})
        st.append(res + copied)

    try:
        score(rows)
        if oracle:  # from this chunk's rows: scored again only when they moved it
            ws = {qid: oracle_weights(done, qid, len(qs[qid]["passages"])) for qid in chunk}
            score([scoring.Row(qid, "oracle", [p["pid"] for p in qs[qid]["passages"]], w) for qid, w in ws.items()
                   if not _valid(qs, done, qid, "oracle", ("param", w))])
    finally:
        slot.remove()
    finish()


def _score_arrow(run: StudyRun, qs: Questions, qids: list[str], gen: Generation, batching: Batching) -> None:
    """PEFT's Arrow router row of each of ``qids``, many questions per call, batched like the other rows."""
    st = run.store("eval")
    per = max(batching.chunk, run.batch_size(batching.batch_size))
    with run.bar("arrow", len(qids), 0, "q") as bar:
        for i in range(0, len(qids), per):
            part = qids[i:i + per]
            st.append(scoring.score_arrow_rows(
                run.model, run.tok, [(q, qs[q], [p["pid"] for p in qs[q]["passages"]]) for q in part],
                run.adapter, generate=gen.generate, max_new_tokens=gen.max_new_tokens,
                batch_size=run.batch_size(batching.batch_size)))
            bar.update(len(part))


def evaluate(run: StudyRun, qs: Questions, want: dict[str, Rows], gen: Generation, batching: Batching, *,
             oracle: bool = False, arrow: bool = False, desc: str = "evaluate", dyprag: Any = None) -> Scored:
    """Score the rows ``want`` (``{qid: rows}``) that ``eval.jsonl`` does not hold yet, ``batching.chunk`` questions
    per call (this rank's share of the chunks under a launcher); with ``oracle``, each question's oracle row after
    its leave-one-out rows; with ``arrow``, PEFT's Arrow router row; ``dyprag``: the source of the DyPRAG rows of
    ``want`` (:class:`.translator.DypragSource`). Returns every scored row of the store."""
    t0 = time.perf_counter()
    done = run.store("eval").done()
    qids = list(want)
    todo = [qid for qid in qids if not all(_valid(qs, done, qid, n, s, _identity(dyprag, n))
                                           for n, s in want[qid].items())
            or (oracle and f"{qid}|oracle" not in done)]
    run.kept(desc, len(qids), len(qids) - len(todo), "questions")
    per = batching.chunk
    chunks = run.mine([todo[i:i + per] for i in range(0, len(todo), per)])
    arrow_todo = run.mine([q for q in qids if arrow and not _valid(qs, done, q, "arrow", None)])
    run.barrier()  # every rank has read the same state before any writes
    if chunks or arrow_todo:
        run.load_model()
    with run.bar(desc, len(qids), len(qids) - len(todo), "q", sum(map(len, chunks)), fraction=True) as bar:
        for chunk in chunks:
            _score_chunk(run, qs, want, chunk, done, oracle, bar, gen, batching.batch_size, dyprag)
    if arrow_todo:
        _score_arrow(run, qs, arrow_todo, gen, batching)
    run.barrier("eval", *((GENERATED, COSINE) if dyprag is not None else ()))
    run.timed(desc, t0, questions=sum(map(len, chunks)), arrow=arrow, device=run.device())
    return run.store("eval").done()
