"""A request's path through the balancer as a chain of stages, each a module of its own (skylb/balancer/stages/
build.py lists them in order): the RequestContext they pass on, the Chain that runs them, and its builder."""

from skylb.balancer.stages.build import STAGE_ORDER, build_chain
from skylb.balancer.stages.chain import Chain, Stage
from skylb.balancer.stages.context import RequestContext
from skylb.balancer.stages.finish import RequestLog

__all__ = ["Chain", "Stage", "RequestContext", "RequestLog", "build_chain", "STAGE_ORDER"]
