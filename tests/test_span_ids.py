"""Our tracer's span and trace ids come from a generator of its own (export/spans.py);
a forked child (a DataLoader worker, a process forked by the user) does not repeat
its parent's ids."""

from __future__ import annotations

import os

import pytest
from opentelemetry.sdk.trace import TracerProvider

from otel_training import semconv as sc
from otel_training.export.spans import StepSpans


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_other_ids_than_its_parent():
    tracer = TracerProvider().get_tracer(sc.SCOPE)
    StepSpans(tracer, {}, 0)  # gives our tracer its ids

    def ids() -> tuple[int, int]:
        span = tracer.start_span("s")
        span.end()
        context = span.get_span_context()
        return context.trace_id, context.span_id

    ids()  # the generator in use before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, ("%d %d" % ids()).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = tuple(map(int, os.read(read, 200).split()))
    os.close(read)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert ids() != child
