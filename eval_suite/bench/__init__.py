"""Speed: the ``bench`` commands (``kernel``, ``decode``, ``trace``, ``train``, ``eval``), the profilers of a decode
step and a prefill, and the tables built from their records (the README's speed table, the multi-GPU report).

May import the core, the kernels, :mod:`eval_suite.report` and :mod:`eval_suite.scoring`; never another
subpackage of the suite (``bench eval`` runs ``eval`` as processes)."""
