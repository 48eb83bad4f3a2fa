"""guardmesh for Python.

* :mod:`guardmesh.guard`: write a guard, a gRPC service that judges an AI
  agent's tool calls (:mod:`guardmesh.guard_aio` for asyncio guards).
* :mod:`guardmesh.coordinator`: ask the mesh about a round of tool calls
  before running them (:class:`Coordinator`, :class:`AsyncCoordinator`),
  and answer guards' asks (:class:`Approver`, :class:`AsyncApprover`, R35).
* :mod:`guardmesh.v1`: the wire types, generated from the
  ``guardmesh/v1/guardmesh.proto`` shipped beside them.
"""

from guardmesh._common import ArgumentsError, MeshCredentials, parse_arguments
from guardmesh.coordinator import (
    ApprovalRefused,
    ApprovalRequest,
    Approver,
    Ask,
    AsyncApprover,
    AsyncCoordinator,
    AsyncSession,
    BatchRefused,
    BatchResult,
    Call,
    Cancel,
    Coordinator,
    Decision,
    GuardTrace,
    Proceed,
    ResultDecision,
    Session,
    Steer,
    ToolResult,
)

__version__ = "0.1.0"

__all__ = [
    "ApprovalRefused",
    "ApprovalRequest",
    "Approver",
    "ArgumentsError",
    "Ask",
    "AsyncApprover",
    "AsyncCoordinator",
    "AsyncSession",
    "BatchRefused",
    "BatchResult",
    "Call",
    "Cancel",
    "Coordinator",
    "Decision",
    "GuardTrace",
    "MeshCredentials",
    "Proceed",
    "ResultDecision",
    "Session",
    "Steer",
    "ToolResult",
    "parse_arguments",
]
