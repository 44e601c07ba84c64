"""The study's stages, each a module of functions taking the :class:`..run.StudyRun`, the options and what the
stage before returned (see :mod:`..pipeline` for their order and caches)."""
