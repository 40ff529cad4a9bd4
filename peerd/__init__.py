"""peerd: decentralized deep-learning training across mixed hardware and links."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("peerd")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+src"

PROTOCOL_VERSION = 2
