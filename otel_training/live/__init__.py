"""``otel-training top``'s live run: an OTLP receiver (``receiver.py``), the processes'
totals and windows (``state.py``), the run as a report (``report.py``) and the
screen (``screen.py``)."""
