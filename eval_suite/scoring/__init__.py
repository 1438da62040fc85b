"""Scoring: an answer's score (exact match, F1, option letter), a run's summary metrics and the paired differences
between schemes with their bootstrap intervals. Imports the core only; everything that reports a figure uses it."""
