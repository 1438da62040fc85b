"""Running the agents: ``eval`` (:mod:`.run_eval`), ``session`` (:mod:`.session_runner`), ``zero-shot``
(:mod:`.zero_shot`), and their machinery: the benchmarks' questions and offline worlds, the executors (one trajectory
at a time, or batched on the engine's rows), the resumable episode log, shards over several GPUs, directory locks,
the timing record, the eval report, and the HTTP client the agents use with ``eval --server``.

May import the core, the agents (``lragent.agents``), :mod:`eval_suite.report` and :mod:`eval_suite.scoring`."""
