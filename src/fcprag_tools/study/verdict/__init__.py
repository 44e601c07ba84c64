"""The study's verdict apart from its I/O: typed records of the scored rows (:mod:`.records`), the arithmetic as pure
functions on them (:mod:`.ship`: what ships in each setting; :mod:`.tables`: every row's figures; :mod:`.choice`:
what to run; :mod:`.dyprag_section`: DyPRAG's section), and beside it the writers of what ``summary.json`` holds:
``report.md`` (:mod:`.markdown`, its DyPRAG parts :mod:`.dyprag_report`), ``report.png`` (:mod:`.plot`) and the
schema check (:mod:`.schema`). ``fcprag_tools.study.summary`` puts them together; the study's verdict stage and
``fcprag report DIR`` build the same records, from the stage's rows or from a folder's files."""
