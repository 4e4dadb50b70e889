"""Services: what the gateway's lifespan opened, typed, for every front end (an HTTP request finds
it as `request.state.services`, the gRPC servicer holds it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import redis.asyncio as aioredis

from fngate.config import GatewaySettings
from gateway.allowance import DecodeAllowance
from gateway.auth import KeyTable
from gateway.catalog import Catalog
from gateway.destinations import CallbackPolicy
from gateway.dispatch import Dispatcher
from gateway.invocations import AsyncInvocations
from gateway.shared_memory import SharedMemory


@dataclasses.dataclass(frozen=True, slots=True)
class Services:
    settings: GatewaySettings
    catalog: Catalog
    dispatcher: Dispatcher
    invocations: AsyncInvocations
    keys: KeyTable
    redis: aioredis.Redis
    """redis-py's client of the queue's Redis, for what is not on the hot path."""
    deployer: Any = None
    """The deploy API's repository (gateway.http.deployments.Deployer)."""
    budget: DecodeAllowance = dataclasses.field(default_factory=lambda: DecodeAllowance(256 * 1024 * 1024))
    """The bytes of bodies being decoded at once (max_decode_bytes)."""
    destinations: CallbackPolicy = dataclasses.field(default_factory=CallbackPolicy)
    """Where callbacks may go (callback_allow)."""
    shared_memory: SharedMemory | None = None
    """The callers' system shared memory regions (allow_client_shm)."""


def services(request: Any) -> Services:
    """The services of an HTTP request (anything with `.state.services`)."""
    found: Services = request.state.services
    return found
