"""The sharing study: ``python -m eval_suite.study plan|run|pack|archive|report`` (:mod:`.driver`) plans and runs the
train / eval / fidelity jobs as processes, resumably; :mod:`.jobs` builds their command lines, :mod:`.decide` the
decisive stage, :mod:`.report` and :mod:`.training_report` the tables.

May import everything below it: the core, :mod:`eval_suite.report`, :mod:`eval_suite.scoring` and
:mod:`eval_suite.evaluate` (it reads episode logs and eval reports)."""
