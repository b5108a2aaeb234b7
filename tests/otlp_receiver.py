"""A real OTLP/gRPC receiver on loopback for end-to-end tests.

Built from ``opentelemetry-proto`` and ``grpcio``: it accepts the same
``Export*ServiceRequest`` messages a Collector does and keeps them in memory.
It can be stopped and started again on the same port (Collector restarts).
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from typing import Callable, List, Optional

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, owner: "OTLPReceiver") -> None:
        self.owner = owner

    def Export(self, request, context):
        with self.owner.lock:
            self.owner.trace_requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, owner: "OTLPReceiver") -> None:
        self.owner = owner

    def Export(self, request, context):
        with self.owner.lock:
            self.owner.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OTLPReceiver:
    def __init__(self, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self.lock = threading.Lock()
        self.trace_requests: List = []
        self.metric_requests: List = []
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OTLPReceiver":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), server)
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- reading what arrived ----------------------------------------------------------
    def _walk(self, requests_attr: str, resource_field: str, scope_field: str, items_field: str) -> list:
        """(resource attributes, scope name, item) for everything received."""
        with self.lock:
            requests = list(getattr(self, requests_attr))
        out = []
        for req in requests:
            for rx in getattr(req, resource_field):
                res = attributes(rx.resource.attributes)
                for sx in getattr(rx, scope_field):
                    out.extend((res, sx.scope.name, item) for item in getattr(sx, items_field))
        return out

    def spans(self) -> list:
        """Every received span as (resource attributes dict, span proto)."""
        return [(res, span) for res, _, span in self.scoped_spans()]

    def scoped_spans(self) -> list:
        return self._walk("trace_requests", "resource_spans", "scope_spans", "spans")

    def metrics(self) -> list:
        """Every received metric as (resource attributes dict, metric proto)."""
        return [(res, metric) for res, _, metric in self.scoped_metrics()]

    def scoped_metrics(self) -> list:
        """(resource attributes, scope name, metric proto) for every received metric."""
        return self._walk("metric_requests", "resource_metrics", "scope_metrics", "metrics")

    def wait_for(self, predicate: Callable[["OTLPReceiver"], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.1)
        return predicate(self)


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs) -> dict:
    return {kv.key: any_value(kv.value) for kv in kvs}


def data_points(metric) -> list:
    kind = metric.WhichOneof("data")
    return list(getattr(metric, kind).data_points) if kind else []
