"""Evaluation suite: the commands that run, score, benchmark and report on the agents (no heavy imports here).

Subpackages by concern, lowest floor first (``tests/test_import_graph.py`` holds each to what it may import):

* :mod:`eval_suite.report` and :mod:`eval_suite.scoring`: Markdown/JSON report helpers; answer scores, summary metrics
  and paired differences. They import only the core (``lragent``).
* :mod:`eval_suite.evaluate`: running the agents on the benchmarks (``eval``, ``session``, ``zero-shot``) and the
  machinery under them: executors, the episode log, shards, locks, timing, the HTTP client ``eval --server`` uses.
* :mod:`eval_suite.bench`: speed benchmarks and profilers (``bench kernel|decode|trace|train|eval``) and their tables.
* :mod:`eval_suite.diagnostics`: what the caches and adapters do (``similarity``, ``fidelity``,
  ``droidspeak-select``, ``data-stats``, the PEFT interop check).
* :mod:`eval_suite.serve`: ``lragent serve`` and ``bench serve``, over :mod:`eval_suite.evaluate`.
* :mod:`eval_suite.study`: the sharing study's driver (``python -m eval_suite.study``), its jobs and reports, over
  :mod:`eval_suite.evaluate` and :mod:`eval_suite.scoring`.
"""
