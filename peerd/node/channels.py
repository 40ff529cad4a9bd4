"""Two gRPC channels per peer address, each its own TCP connection: "control" for the small calls
(heartbeats, hellos, tokens, notices, pings) and "data" for tensors and bulk probes, so that a
heartbeat never waits behind megabytes of a tensor stream in one connection's send queue; and the
TLS rule they follow.

Mutual TLS (`tls`, default "auto") protects every connection to or from an address that is not
loopback: both ends present their node certificate (peerd.net.pki), issued by the cluster CA, and
verify the other's against it; a client checks the server's certificate name `peerd` (no address
or host name is in any certificate), and learns which node answered from the signed reply
(peerd.net.auth). "on": TLS on loopback too. "off": plaintext everywhere (a trusted LAN; calls are
still signed and bound to their receiver and body, streamed tensor bodies are not protected).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from peerd.config import NodeConfig
from peerd.net.pki import TLS_NAME
from peerd.net.wirecheck import is_loopback_host, split_address

log = logging.getLogger("peerd.daemon")

TLS_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Tls:
    """This node's TLS material (PEM) and the mode that decides where it is used."""
    mode: str
    ca_pem: bytes
    key_pem: bytes
    cert_pem: bytes

    def wanted(self, host: str) -> bool:
        """TLS to or on `host` (an address's host part): always with "on", never with "off",
        with "auto" unless it is loopback."""
        if self.mode == "on":
            return True
        if self.mode == "off":
            return False
        return not is_loopback_host(host)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)


def host_of(address: str) -> str:
    hp = split_address(address)
    return hp[0] if hp is not None else address.rpartition(":")[0].strip("[]")


class ChannelPool:
    PURPOSES = ("control", "data")

    def __init__(self, node: NodeConfig, options: list, tls: Tls | None = None) -> None:
        self.node = node
        # peerd.net.dataplane.grpc_options(cfg); a local subchannel pool gives each channel its own
        # connection (gRPC shares one between channels of equal arguments otherwise)
        self.options = [*options, ("grpc.use_local_subchannel_pool", 1)]
        self.tls = tls
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()
        self._routes: dict[str, str] = {}     # a peer's address -> where we dial it (its tunnel, peerd.node.tunnels)

    def secure(self, address: str) -> bool:
        return self.tls is not None and self.tls.wanted(host_of(address))

    def get(self, address: str, purpose: str = "control") -> grpc.aio.Channel:
        channel = self._channels.get((address, purpose))
        if channel is None:
            channel = self._channels[(address, purpose)] = self.open(address, self._routes.get(address, address))
        return channel

    def open(self, address: str, dial: str = "") -> grpc.aio.Channel:
        """A new channel (its own connection) to `address`, not kept by the pool; dialled at `dial`
        when given. TLS or not as `address` says, wherever it is dialled: a tunnel carries TLS
        end to end."""
        dial = dial or address
        if self.secure(address):
            return grpc.aio.secure_channel(dial, self.tls.channel_credentials(),
                                           options=[*self.options, ("grpc.ssl_target_name_override", TLS_NAME)])
        return grpc.aio.insecure_channel(dial, options=self.options)

    def routed(self, address: str) -> bool:
        """We dial `address` through a tunnel or a relay."""
        return address in self._routes

    def route(self, address: str, dial: str | None) -> None:
        """Dial `address` at `dial` (a tunnel's loopback port) from now on, or directly again (None)."""
        if self._routes.get(address) == dial:
            return
        if dial is None:
            self._routes.pop(address, None)
        else:
            self._routes[address] = dial
        for purpose in self.PURPOSES:
            channel = self._channels.pop((address, purpose), None)
            if channel is not None:
                self._close_later(channel, f"close channel {address} {purpose}")

    def _close_later(self, channel: grpc.aio.Channel, name: str) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(), name=name)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def drop(self, address: str, unless_ready: bool = False) -> None:
        """Forget our channel to `address` (the next call dials afresh) and close it, failing the
        calls still on it. A cut link leaves its TCP connection open but dead: every call on it
        hangs until its own deadline, until keepalive (keepalive_interval + keepalive_timeout)
        gives up on it; and a channel whose connection attempts failed during an outage waits out
        gRPC's reconnect back-off (up to minutes) after the outage. A peer found dead, or back,
        is dialled on a fresh connection instead."""
        for purpose in self.PURPOSES:
            channel = self._channels.get((address, purpose))
            if channel is None or (unless_ready and
                                   channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY):
                continue
            del self._channels[(address, purpose)]
            self._close_later(channel, f"close channel {address} {purpose}")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._closing:
            await asyncio.wait(self._closing, timeout=1.0)
