"""What a run's numbers say: findings, advice and the text we print about a run.

The runtime prints the run-end table with it; the report (``otel_training/report/``)
and the ``otel-training`` commands use it too.

- ``verdict.py``: ``diagnose(run)``, the ranked findings of a :class:`Run` or of a
  report's ``Evidence`` (``evidence.py``: the typed input, ranks included);
  ``verdict_ranks.py`` compares ranks (stragglers); ``advice.py`` says what fits the
  run; ``finding.py`` holds ``Finding``;
- ``summary_text.py``: the run-end table; ``findings_text.py``: the verdict and the self-check; ``measures_text.py``:
  coverage, compute and memory lines; ``formatting.py`` and ``words.py``: numbers,
  tables and counts as we print them.
"""
