"""Trainer side of peerd: flat parameter buffers, the exchange interface, DecentralizedOptimizer,
built-in tasks. Pure torch; the network lives in the daemon, behind ``Exchange``."""
from peerd.train.client import DaemonExchange, NoDaemon, attach
from peerd.train.exchange import Exchange, LocalExchange, LocalGroup, MixResult, topology_weights
from peerd.train.flat import FlatParams, Layout, LayoutMismatch, flatten_module
from peerd.train.optim import DecentralizedOptimizer

__all__ = ["DaemonExchange", "NoDaemon", "attach", "DecentralizedOptimizer", "Exchange", "FlatParams", "Layout", "LayoutMismatch",
           "LocalExchange", "LocalGroup", "MixResult", "flatten_module", "topology_weights"]
