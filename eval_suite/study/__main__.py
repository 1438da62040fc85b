"""``python -m eval_suite.study``: the study driver's command line (:mod:`eval_suite.study.driver`)."""

import sys

from eval_suite.study.driver import main

sys.exit(main())
