"""Continuous-batching scheduler (device-free): ``Scheduler``, ``Request``, ``WaitingQueue``."""

from llmc.runtime.scheduler.core import Scheduler
from llmc.runtime.scheduler.queue import WaitingQueue
from llmc.runtime.scheduler.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus", "Scheduler", "WaitingQueue"]
