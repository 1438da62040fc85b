"""What the caches and adapters do: cache similarity across agents (``similarity``), each scheme's fidelity against
``non_shared`` (``fidelity``), DroidSpeak's layer choice (``droidspeak-select``), the role data's statistics
(``data-stats``) and the PEFT interop check.

May import the core, :mod:`eval_suite.report` and :mod:`eval_suite.scoring`; never another subpackage of the suite."""
