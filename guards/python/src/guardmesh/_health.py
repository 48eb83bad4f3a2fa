"""``grpc.health.v1.Health`` for guards, without a dependency on
grpcio-health-checking: its two messages are small enough to encode by hand
(HealthCheckRequest {string service = 1}, HealthCheckResponse {enum status =
1}), which also keeps the package's runtime dependencies to grpcio and
protobuf and avoids registering a second copy of health.proto."""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Iterator

import grpc
import grpc.aio

SERVICE_NAME = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def decode_request(data: bytes) -> str:
    """The ``service`` of a HealthCheckRequest (unknown fields skipped)."""
    pos, service = 0, ""
    while pos < len(data):
        key, pos = _varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            if key >> 3 == 1:
                service = data[pos:pos + length].decode("utf-8")
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return service


def encode_response(status: int) -> bytes:
    return b"" if status == 0 else bytes([0x08, status])


class Health:
    """Statuses by service name ("" is the server as a whole)."""

    def __init__(self) -> None:
        self._statuses: dict[str, int] = {}
        self._changed = threading.Condition()
        self._version = 0
        self._shutdown = False

    def set(self, service: str, status: int) -> None:
        with self._changed:
            self._statuses[service] = status
            self._version += 1
            self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        with self._changed:
            self._shutdown = True
            for service in self._statuses:
                self._statuses[service] = NOT_SERVING
            self._version += 1
            self._changed.notify_all()

    def status(self, service: str) -> int:
        with self._changed:
            return self._statuses.get(service, SERVICE_UNKNOWN)

    # -- sync server ----------------------------------------------------------

    def _check(self, service: str, context: grpc.ServicerContext) -> bytes:
        with self._changed:
            status = self._statuses.get(service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return encode_response(status or 0)

    def _watch(self, service: str, context: grpc.ServicerContext) -> Iterator[bytes]:
        last = -1
        while context.is_active():
            with self._changed:
                status = self._statuses.get(service, SERVICE_UNKNOWN)
                version = self._version
            if status != last:
                last = status
                yield encode_response(status)
            with self._changed:
                if self._shutdown and status == NOT_SERVING:
                    return
                self._changed.wait_for(lambda: self._version != version, timeout=1.0)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self._check, request_deserializer=decode_request,
                response_serializer=lambda b: b),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self._watch, request_deserializer=decode_request,
                response_serializer=lambda b: b),
        })

    # -- asyncio server -------------------------------------------------------

    async def _check_aio(self, service: str, context: grpc.aio.ServicerContext[str, bytes]) -> bytes:
        with self._changed:
            status = self._statuses.get(service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return encode_response(status or 0)

    async def _watch_aio(self, service: str,
                         context: grpc.aio.ServicerContext[str, bytes]) -> AsyncIterator[bytes]:
        last = -1
        while True:
            status = self.status(service)
            if status != last:
                last = status
                yield encode_response(status)
            if self._shutdown and status == NOT_SERVING:
                return
            await asyncio.sleep(0.2)

    def aio_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self._check_aio, request_deserializer=decode_request,
                response_serializer=lambda b: b),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self._watch_aio, request_deserializer=decode_request,
                response_serializer=lambda b: b),
        })
