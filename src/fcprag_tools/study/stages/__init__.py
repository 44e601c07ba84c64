"""The study's stages, each a module of functions taking the :class:`..run.StudyRun`, the parts of the options it
reads and what the stage before returned (see :mod:`..pipeline` for their order and caches)."""
