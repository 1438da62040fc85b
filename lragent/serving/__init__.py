"""Serving the role adapters: held trajectories matched by text, continuous batching over the engine's rows.

The HTTP-free part of ``lragent serve`` (the OpenAI-compatible front end is :mod:`eval_suite.serve`):
:mod:`~lragent.serving.trajectories` (text trajectories and prompt matching), :mod:`~lragent.serving.rows` (forking a
row's caches), :mod:`~lragent.serving.scheduler` (admission and decoding), :mod:`~lragent.serving.metrics`
(Prometheus text), :mod:`~lragent.serving.model` (the model with a base-model role).
"""
