"""Views of runs: what ``otel-training report``, ``compare``, the HTML page and the demo show.

- ``sources.py``: summary files read (through the run model) and their ranks merged;
  ``prometheus.py`` the same report from a Prometheus; ``series.py`` the run over time
  from Prometheus; ``build.py`` one report from either, with its mode and findings;
- ``text.py``: the report as text; ``compare.py``: two runs compared against their noise;
- ``charts.py``: the charts' specs; ``page.py`` (and ``assets/``): the offline HTML page.

It reads the run model (``aggregate/``) and uses ``diagnosis/`` for findings and text;
the commands in ``cli/`` parse arguments, print and set exit status.
"""
