"""``lragent serve``'s OpenAI-compatible front end over :mod:`lragent.serving`, and its ``bench serve`` load generator
(the client side, which ``eval --server URL`` runs the agents through, is :mod:`eval_suite.evaluate.server_client`).

:mod:`~eval_suite.serve.protocol` (request and response bodies, the error object), :mod:`~eval_suite.serve.api_server`
(the app and its error handlers), :mod:`~eval_suite.serve.serving_completion` and
:mod:`~eval_suite.serve.serving_chat` (one handler module per endpoint over :mod:`~eval_suite.serve.engine_client`),
:mod:`~eval_suite.serve.serve_command` (the command), :mod:`~eval_suite.serve.bench_serve` (the load generator).

May import the core, :mod:`eval_suite.report`, :mod:`eval_suite.scoring` and :mod:`eval_suite.evaluate`.
"""
