"""Every setting of peerd, in sections: every timeout, interval, bound and default in one place.

Code reads a setting through its section: ``cfg.train.mix_timeout``, ``cfg.links.probe_budget``. A
component takes the section it needs (``Membership(cfg.membership)``), or the whole Config.

Each setting also has one flat key, which names it everywhere outside Python: the section's prefix
and the field name (``train_mix_timeout``), or the field's own ``key`` where it predates the
sections (``heartbeat_interval``, ``hop_max_ig``). Values come from, lowest precedence first:
- the defaults below;
- a TOML file (``--config FILE``), either in sections (``[train]`` then ``mix_timeout = 90``) or as
  top-level flat keys (``train_mix_timeout = 90``, the format before sections: still loads);
- ``PEERD_<FLAT KEY>`` environment variables (``PEERD_TRAIN_MIX_TIMEOUT=90``);
- command-line flags (``--train-mix-timeout 90``) for the daemon's sections.

`peerd up --help` shows the common flags; `peerd up --help-all` every one. The reference,
docs/configuration.md, is generated from this module (`peerd config reference`), and a test fails
when it is stale.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


def default_data_dir() -> str:
    """Where `peerd up` and `peerd status` look when --data-dir is not given."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "peerd")


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A setting: its default, its help text, and options: `key` (its flat name, when not the
    section's prefix + the field name), `flag` (the CLI flag's name), `choices`, `common` (shown
    by `peerd up --help`; the rest by --help-all), `metavar` (a list's item in --help; default
    HOST:PORT)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class NodeConfig:
    """This host: addresses, identity, secret and TLS, logging, shutdown."""
    PREFIX: ClassVar[str] = ''
    SCOPE: ClassVar[str] = 'daemon'
    listen: str = _f("127.0.0.1:7070", "HOST:PORT where the Peer service listens (0.0.0.0 for all interfaces)", common=True)
    advertise_address: str = _f("", "HOST:PORT other daemons should dial; default: the listen address, "
                                    "or the source address peers see when listening on 0.0.0.0", common=True)
    data_dir: str = _f("", "directory for node id, control socket, checkpoints and logs "
                           "(default: $XDG_DATA_HOME/peerd or ~/.local/share/peerd)", common=True)
    run_id: str = _f("default", "training run this daemon belongs to; daemons of other runs are refused", common=True)
    peers: tuple[str, ...] = _f((), "seed peer HOST:PORT to contact (repeatable)", flag="peer", multiple=True, common=True)
    site: str = _f("", "this host's lab, office or cloud region: a run's ring crosses between "
                       "sites as few times as it can", common=True)
    secret_file: str = _f("", "file holding the cluster secret (or set PEERD_SECRET)", common=True)
    tls_cert: str = _f("", "this node's PEM certificate from your own CA (with --tls-key and --tls-ca): that CA "
                           "decides membership instead of the cluster secret (docs/security.md)", common=True)
    tls_key: str = _f("", "the PEM private key of --tls-cert (EC P-256/P-384 or RSA); this node's id is the hash "
                          "of its public key", common=True)
    tls_ca: str = _f("", "PEM bundle of your CA certificate(s): the daemons they certify are the cluster",
                     common=True)
    event_loop: str = _f("auto", "asyncio loop: auto (uvloop when importable), uvloop, asyncio",
                         choices=("auto", "uvloop", "asyncio"))
    worker_nice: int = _f(10, "niceness the daemon's worker threads (sums, checksums and copies of whole models) "
                              "add to its own: its event loop, heartbeats and the trainer go first on a busy "
                              "host (0: same priority; Linux)")
    log_level: str = _f("info", "log level: debug, info, warning, error", common=True,
                        choices=("debug", "info", "warning", "error"))
    log_format: str = _f("text", "log lines as text, or json: one object per line (time, level, logger, "
                                 "message)", common=True, choices=("text", "json"))
    rpc_timeout: float = _f(2.0, "deadline of one control-plane RPC to a peer (Hello, Heartbeat, Ping, Leave)")
    shutdown_grace: float = _f(1.0, "seconds in-flight RPCs get at shutdown")
    shutdown_timeout: float = _f(4.0, "bound on the whole shutdown after SIGINT/SIGTERM: what is left then "
                                      "(trainer, slots, control socket) is killed or removed at once")
    max_control_message_bytes: int = _f(4 * 1024 * 1024, "largest control-plane message accepted, bytes")
    # --- metrics (peerd/node/metrics.py) ---
    metrics_port: int = _f(0, "serve Prometheus metrics on this HTTP port (0: off)", common=True)
    metrics_address: str = _f("", "address the metrics endpoint binds to; default: the host of --listen "
                                  "(a loopback daemon serves metrics on loopback only)")
    metrics_links: str = _f("own", "link metrics: own (this host's measured links) or all (the whole "
                                   "gossiped link matrix, N^2 series)", choices=("own", "all"))
    metrics_scrape_timeout: float = _f(2.0, "longest a scrape waits for the daemon's event loop to read its "
                                            "state; a busier loop answers peerd_scrape_ok 0")
    swarm_timeout: float = _f(2.0, "longest `peerd top` and the live view of `peerd train` wait for the "
                                   "peers' answers (each peer asked at once, through this daemon)")
    # --- reachability and tunnels (peerd/node/tunnels.py, docs/nat.md) ---
    reachable: str = _f("auto", "can peers dial this host: auto (each peer checks at Hello; this host keeps a "
                                "tunnel to every peer that could not), no (behind NAT or a firewall: keep "
                                "tunnels to every peer), yes (never tunnel)", choices=("auto", "yes", "no"))
    dial_back_timeout: float = _f(1.0, "longest a Hello's receiver tries to connect back to the caller's "
                                       "address (at most half of rpc_timeout: the Hello's reply waits for it)")
    tunnel_spares: int = _f(2, "idle tunnel calls kept open to each peer that cannot dial us: a new "
                               "connection of that peer takes one at once")
    tunnel_retry: float = _f(1.0, "seconds before a tunnel that failed to open is tried again (doubling, up "
                                  "to membership's connect_retry_max)")
    tunnel_chunk_bytes: int = _f(1 << 20, "most bytes of a tunnelled connection in one tunnel message")
    relay: bool = _f(False, "relay tunnels between peers that cannot dial each other (both behind NAT): "
                            "this host must be reachable; its bandwidth carries their traffic twice")
    relay_budget_bytes: int = _f(0, "most bytes this host relays in all (0: no limit); then it refuses relaying")
    relay_max_connections: int = _f(64, "most relayed connections at once")


@dataclass
class MembershipConfig:
    """Membership and failure detection (peerd/net/membership.py, peerd/node/membership_service.py)."""
    PREFIX: ClassVar[str] = ''
    SCOPE: ClassVar[str] = 'daemon'
    heartbeat_interval: float = _f(1.0, "seconds between heartbeats to each peer")
    suspect_after: float = _f(3.0, "seconds without direct contact before a peer is suspect")
    dead_after: float = _f(6.0, "seconds without direct contact before a peer is dead")
    connect_retry_max: float = _f(10.0, "longest back-off between attempts to reach an unanswering or dead peer")
    forget_dead_after: float = _f(3600.0, "seconds after which a dead peer is dropped from the table")
    max_peers: int = _f(1024, "most peers kept in the table (gossip beyond this is ignored)")
    peer_gossip_full_interval: float = _f(30.0, "seconds between heartbeats that carry a peer our whole peer "
                                                "table; those between carry only rows that changed")
    leave_timeout: float = _f(1.0, "seconds spent telling peers we leave, at shutdown")
    # --- issue 36 ---
    gossip_new_candidates: int = _f(32, "most new addresses to contact one gossip message (heartbeat, reply, "
                                        "Hello reply) may add")


@dataclass
class AuthConfig:
    """Authentication and refusals (peerd/net/auth.py)."""
    PREFIX: ClassVar[str] = 'auth_'
    SCOPE: ClassVar[str] = 'daemon'
    max_skew: float = _f(30.0, "largest clock difference accepted on an authenticated RPC, seconds")
    replay_cache: int = _f(100_000, "nonces remembered to refuse replays (bounded memory)")
    log_every: float = _f(60.0, "seconds between repeated log lines about one refused source")
    refusal_burst: int = _f(50, "refused calls one (address, claimed node) may cost before it is "
                                     "rate-limited: later calls are refused at once, unverified and unlogged")
    refusal_rate: float = _f(5.0, "refused calls per second one (address, claimed node) earns back")
    max_sources: int = _f(4096, "most rate-limit entries (one per TLS peer node or plaintext connection) and "
                                     "log entries (one per source address) kept; the least recently refused is "
                                     "forgotten first")
    # --- issue 36: identity, TLS, load bounds (docs/security.md) ---
    tls: str = _f("auto", "mutual TLS on the Peer service with the node certificates: auto (on every address "
                          "that is not loopback), on (everywhere), off (plaintext: a trusted LAN only)",
                  key='tls', choices=("auto", "on", "off"), common=True)
    max_concurrent_calls: int = _f(1024, "most Peer RPCs served at once; more are refused (RESOURCE_EXHAUSTED) "
                                         "before anything of them is read")
    max_streams_per_connection: int = _f(128, "most concurrent RPCs on one connection (HTTP/2 streams); a "
                                              "client waits for a free one")
    max_revocations: int = _f(4096, "most node revocations kept (and gossiped)")
    plaintext_window: int = _f(1 << 20, "receive window per stream, bytes, of a plaintext Peer port on loopback "
                                        "(fixed: what a refused call can make the daemon hold; BDP probing is "
                                        "off there, on loopback it costs little)")


@dataclass
class MdnsConfig:
    """Discovery on the local network: mDNS / DNS-SD (peerd/net/discovery.py)."""
    PREFIX: ClassVar[str] = 'mdns_'
    SCOPE: ClassVar[str] = 'daemon'
    enabled: bool = _f(True, "announce and browse _peerd._tcp.local. on the local network "
                          "(--no-mdns turns it off; --peer seeds work either way)", key='mdns', common=True)
    interface: str = _f("", "interface name(s) or local IP(s), comma-separated, that mDNS binds to; default: "
                            "every interface with IPv4 except those matching mdns_skip_interfaces, "
                            "which are used only when nothing else exists", key='interface', common=True)
    skip_interfaces: tuple[str, ...] = _f(("lo", "docker*", "br-*", "veth*"),
                                               "interface name patterns mDNS avoids by default (fnmatch)",
                                               metavar="PATTERN")
    register_timeout: float = _f(10.0, "seconds to probe for and announce our service name")
    resolve_timeout: float = _f(3.0, "seconds to resolve one announced service (SRV, TXT, addresses)")
    stop_timeout: float = _f(2.0, "seconds spent sending the goodbye and closing mDNS at shutdown")
    max_resolving: int = _f(16, "most announced services resolved concurrently")
    max_names: int = _f(4096, "most distinct service names tracked (accepted, pending or ignored)")
    max_txt_bytes: int = _f(1024, "largest TXT record accepted from an announcement, bytes")


@dataclass
class LinksConfig:
    """Link probes, the link matrix and its gossip (peerd/net/links.py, peerd/node/links_service.py)."""
    PREFIX: ClassVar[str] = 'link_'
    SCOPE: ClassVar[str] = 'daemon'
    rtt_interval: float = _f(5.0, "seconds between RTT pings to each peer when no other RTT sample came")
    bw_interval: float = _f(60.0, "shortest seconds between bandwidth probes to a peer whose estimate "
                                       "is not refreshed by data-plane traffic (stretched to hold the budget)")
    probe_budget: float = _f(0.002, "largest fraction of a link's time bandwidth probes may use "
                                         "at steady state (0.002 = 0.2 %)")
    probe_seconds: float = _f(0.2, "target duration of one bandwidth probe at the estimated bandwidth")
    probe_rtts: float = _f(8.0, "a bandwidth probe lasts at least this many RTTs, so the RTT is a small error")
    probe_min_bytes: int = _f(64 * 1024, "smallest bandwidth probe, bytes (also the first, unsized probe)")
    probe_max_bytes: int = _f(64 * 1024 * 1024, "largest bandwidth probe, bytes")
    ping_bytes: int = _f(64, "payload of an RTT ping, bytes")
    probe_timeout_min: float = _f(5.0, "least deadline of one probe; longer probes get 4x their expected time")
    ewma_alpha: float = _f(0.25, "weight of a new sample in the link EWMAs (0 < alpha <= 1)")
    change_fraction: float = _f(0.5, "relative deviation of a data-plane sample from the estimate "
                                          "that triggers an early re-probe")
    rtt_change_floor: float = _f(0.002, "RTT deviations below this many seconds never trigger a re-probe")
    rtt_min_window: float = _f(30.0, "seconds the least RTT seen is kept as the path's base RTT "
                                          "(used to size probes and taken off transfer times)")
    min_probe_gap: float = _f(2.0, "least seconds between two probes of one kind to one peer")
    warmup_samples: int = _f(3, "bandwidth samples taken link_min_probe_gap apart before the "
                                     "periodic schedule applies")
    warmup_gain: float = _f(0.1, "warm-up goes on while a probe twice as big reads more than this fraction faster")
    warmup_flat: int = _f(2, "warm-up ends after this many trusted probes in a row that did not read faster")
    min_transfer_bytes: int = _f(64 * 1024, "smallest data-plane transfer used as a bandwidth sample, bytes")
    min_transfer_seconds: float = _f(0.05, "shortest data-plane transfer (RTT taken off) used as a "
                                                "bandwidth sample, seconds")
    retry_max: float = _f(60.0, "longest back-off after failed probes to a peer, seconds")
    forget_after: float = _f(900.0, "seconds after which a link estimate nobody refreshed is dropped")
    max_entries: int = _f(16384, "most (measurer, target) entries kept in the link matrix")
    capacity_window: float = _f(900.0, "seconds a trusted bandwidth sample counts towards the link's capacity "
                                            "(the highest recent sample; the newest one always counts)")
    capacity_samples: int = _f(8, "most recent trusted bandwidth samples kept for the capacity figure")
    capacity_dip: float = _f(0.2, "a probe reading more than this fraction below the capacity is re-checked")
    capacity_recheck: float = _f(0.125, "the first re-check of a low probe comes this fraction of the probe "
                                             "period after it, the next ones link_settle_growth times later each")
    capacity_confirm: int = _f(2, "re-checks that must all read low, after a low probe, before the "
                                       "capacity drops to what they read (a real change, not cross traffic)")
    probe_growth_max: float = _f(4.0, "after warm-up a probe is at most this many times the size "
                                           "max(link_probe_seconds, link_probe_rtts x RTT) at the capacity")
    settle_growth: float = _f(2.0, "after warm-up the gap between bandwidth probes grows by this factor per "
                                        "probe, from 2 x link_min_probe_gap up to the steady period")
    gossip_max_entries: int = _f(1024, "most link-matrix entries one heartbeat (or its reply) carries")
    probe_jitter: float = _f(2.0, "a bandwidth probe starts after a random delay of up to this many seconds, "
                                       "so hosts do not probe a shared bottleneck in lock-step")
    gossip_full_interval: float = _f(30.0, "seconds between heartbeats that carry a peer the whole link "
                                                "matrix; those between carry only the entries that changed")
    gossip_change: float = _f(0.1, "relative move of an entry's capacity, throughput or RTT (the RTT also by "
                                        "more than link_rtt_change_floor) that makes it news for the next "
                                        "heartbeats; smaller moves wait for the full gossip")


@dataclass
class DataPlaneConfig:
    """Tensor transfers (peerd/net/dataplane.py)."""
    PREFIX: ClassVar[str] = 'dataplane_'
    SCOPE: ClassVar[str] = 'daemon'
    chunk_bytes: int = _f(1 << 20, "bytes of tensor data per stream message (1 MiB measured best)")
    max_transfer_bytes: int = _f(4 << 30, "largest tensor buffer accepted in one transfer, bytes")
    peer_bytes: int = _f(4 << 30, "receive bytes held per peer (in flight or not yet released)")
    total_bytes: int = _f(8 << 30, "receive bytes held over all peers")
    admit_timeout: float = _f(5.0, "seconds a transfer waits for the byte budget before it is refused")
    stall_timeout: float = _f(20.0, "seconds without a stream message before a transfer is aborted")
    min_rate: int = _f(1_000_000, "bytes/s below which a transfer is too slow: sets its deadline (our pushes in "
                                  "flight at once share it: they share our uplink)")
    max_rpcs_per_peer: int = _f(4, "data-plane RPCs in flight to (and accepted from) one peer")
    max_header_bytes: int = _f(1 << 20, "largest tensor header (the layout) accepted, bytes")
    max_tensors: int = _f(1 << 16, "most tensors in one transfer's layout")
    pool_bytes: int = _f(4 << 30, "idle receive/scratch buffers kept for reuse, bytes")
    pool_models: float = _f(1.0, "idle receive/scratch buffers kept for reuse, in models: while a run is set, "
                                 "the pool holds at most this many times its model's bytes (and pool_bytes)")
    deliver_timeout: float = _f(5.0, "seconds a received transfer waits for the daemon to take it")
    checksum: str = _f("crc32c", "checksum of sent transfers: crc32c (the CPU's CRC instruction, ~10 GB/s), "
                                 "crc32 (zlib, ~2 GB/s) or none; receivers check whichever a transfer carries",
                       choices=("crc32c", "crc32", "none"))
    compression: str = _f("none", "float32 tensors on the wire: none, fp16 or bf16 (cast), int8 or int4 (blockwise, "
                                  "as increments of a public copy: error feedback; docs/low-communication.md)",
                          choices=("none", "fp16", "bf16", "int8", "int4"))
    copies_max: int = _f(64, "public copies of senders held for pushes in copy mode (int8/int4, DiLoCo fragments): "
                             "each is one model; beyond it the least recently used goes (its sender then sends a keyframe)")
    keepalive_interval: float = _f(10.0, "seconds between gRPC keepalive pings on idle connections", key='keepalive_interval')
    keepalive_timeout: float = _f(5.0, "seconds to wait for a keepalive ack before the connection is dead", key='keepalive_timeout')


@dataclass
class TrainConfig:
    """Training runs in the daemon (peerd train; peerd/node/run/)."""
    PREFIX: ClassVar[str] = 'train_'
    SCOPE: ClassVar[str] = 'daemon'
    join_timeout: float = _f(60.0, "seconds `peerd train` waits for the run's world to be present")
    early_updates: int = _f(64, "peers' updates held when they arrive before this host's run starts")
    progress_interval: float = _f(0.5, "seconds between progress records streamed to `peerd train`")
    max_restarts: int = _f(5, "times a crashed trainer is restarted from its checkpoint before the run fails")
    restart_delay: float = _f(1.0, "seconds before a crashed trainer is restarted")
    drain_timeout: float = _f(30.0, "most seconds a finished run keeps serving peers that are still training "
                                          "(it stops as soon as every other host finished or is gone)")
    pause_timeout: float = _f(3600.0, "most seconds a trainer stays paused (`peerd ctl pause`) before it "
                                            "resumes by itself")
    silent_peer_timeout: float = _f(10.0, "most seconds a host waits on a live neighbour that sends nothing, "
                                                "plus two of its own iterations (a DiLoCo round may last minutes) "
                                                "and the update's transfer allowance (train_transfer_slack) "
                                                "(then mixes without it until its next update); one whose "
                                                "update is streaming in is waited for up to 3/4 of "
                                                "the trainer's mix bound (train_mix_timeout); a crashed or "
                                                "finished trainer is announced at once and not waited for at all")
    estimates_interval: float = _f(10.0, "seconds between the link estimates a run feeds to a policy that "
                                               "uses them (NetMax's peer probabilities: a re-solve costs tenths of "
                                               "a second of CPU), from the link matrix and the run's own pulls; the "
                                               "first ones as soon as there are any")
    pull_timeout: float = _f(5.0, "most seconds one pull (NetMax, AD-PSGD) may go unanswered (failed, refused, "
                                        "not found, or no reply) before the policy pulls another peer or takes "
                                        "the local step, plus the transfer's allowance (train_transfer_slack); "
                                        "keep it below train_silent_peer_timeout")
    budget_interval: float = _f(1.0, "`peerd train --budget swarm`: seconds between counts of the run's "
                                           "iterations over its hosts (one small RPC to each member)")
    transfer_slack: float = _f(2.0, "the pull and silent-neighbour bounds grow by this many times the model's "
                                          "expected transfer from that peer (bytes over the measured bandwidth, "
                                          "or over dataplane_min_rate where unmeasured or slower), and so does "
                                          "train_mix_timeout by the longest of them; a pull's bound is capped at "
                                          "half of the mix bound, a silent neighbour's at half of "
                                          "train_mix_timeout; 0: fixed bounds")
    pull_backoff: float = _f(10.0, "most seconds a peer whose pulls keep failing rests before it is pulled again "
                                         "(the other peers are, or the host steps locally); not for good: a hiccup "
                                         "does not remove a link")
    pull_backoff_first: float = _f(1.0, "seconds a peer rests after its first failed pull; doubled per failure "
                                               "in a row up to train_pull_backoff, reset by an answered pull (a peer "
                                               "whose trainer is still starting answers moments later)")
    mix_timeout: float = _f(60.0, "seconds a trainer waits for the mixed parameters of one "
                                        "iteration, plus two of its own iterations and the longest transfer "
                                        "allowance of a neighbour's update (train_transfer_slack), before "
                                        "giving up with an error")
    join_pull_timeout: float = _f(10.0, "seconds a host joining a running swarm waits for one neighbour's "
                                        "parameters before trying the next, plus the model's transfer allowance "
                                        "(train_transfer_slack), within train_attach_timeout")
    attach_timeout: float = _f(600.0, "seconds a trainer's Attach may take: a host joining a running swarm "
                                      "pulls a neighbour's parameters within it (1 GB over 50 Mbit: 160 s)")
    join_min_lead: int = _f(4, "iterations the swarm must be ahead of this host's own checkpoint before a "
                                  "joining host, or a restarted trainer, starts from a neighbour's parameters instead")
    update_max_abs: float = _f(1e6, "largest |value| accepted in a peer's parameters (0: no bound); "
                                    "larger updates are dropped and counted against the peer", key='update_max_abs')
    update_max_norm_ratio: float = _f(100.0, "largest ratio of a peer's parameter norm to our own accepted "
                                             "(0: no bound); larger updates are dropped and counted", key='update_max_norm_ratio')
    peer_max_offences: int = _f(5, "bad updates (NaN/Inf, too large, wrong layout) from one peer before it "
                                   "is flagged and its updates ignored for peer_cooldown", key='peer_max_offences')
    peer_cooldown: float = _f(30.0, "seconds a flagged peer's updates are ignored before it is re-admitted", key='peer_cooldown')
    checkpoint_every: int = _f(25, "iterations between trainer checkpoints (a failed write keeps the "
                                   "previous checkpoint and training goes on)", key='checkpoint_every')
    max_world: int = _f(0, "hosts a run may grow to by late joiners when `peerd train` gives no "
                                 "--max-world (0: the run's --world, no new host joins)")
    join_retry: float = _f(0.5, "seconds a host that wants to join a run waits before asking again "
                                      "(contested rank, a member not answering, the run not found yet)")
    coalesce_updates: bool = _f(False, "for Hop's backup and staleness modes, a newer update to a neighbour "
                                             "replaces an older one still waiting in the sender's queue (the "
                                             "receiver takes a neighbour's next update in place of one it never "
                                             "got); off by default until the benchmark matrix is re-run with it "
                                             "(docs/algorithms.md, ring order)")
    sum_on_arrival: bool = _f(True, "for D-PSGD and Hop's standard mode, add each neighbour's update into the "
                                    "mix chunk by chunk as it arrives instead of receiving it whole: memory "
                                    "O(model) whatever the degree (peerd/node/run/eagersum.py)")
    sum_wait: float = _f(1.0, "with sum_on_arrival, seconds an update of an iteration not yet published here "
                              "waits (its stream held) for the slot its mix will use, before it is summed in a "
                              "scratch buffer (one more model's worth of memory)")
    attach_wait: float = _f(5.0, "with sum_on_arrival, seconds a neighbour's update that arrives before this "
                                 "host's run started and its trainer attached waits for them (its stream held), "
                                 "so that it is summed "
                                 "as it arrives instead of held whole (one model's worth of memory per early "
                                 "neighbour); less than dataplane_stall_timeout")
    slot_wait: float = _f(0.25, "seconds a Mix reply may wait for our pushes of that iteration to end, where "
                                "they stream straight from the trainer's slot, before they go on from a copy "
                                "(one model's worth of memory and a copy saved when they end in time)")
    degraded_share: float = _f(0.5, "a run whose mixes were more than this share partial (a neighbour it should "
                                    "have mixed was silent, dead or flagged) ends 'degraded' and `peerd train` "
                                    "exits 3: D-PSGD that mixed alone was local SGD")
    corpus_build_timeout: float = _f(600.0, "seconds a trainer waits for another process that is building the "
                                            "stdlib corpus cache of the `gpt` task (the lock), before it gives up")
    device_chunk_bytes: int = _f(8 << 20, "a GPU trainer copies the mix from host memory to the device in "
                                          "chunks of this many bytes, each applied while the next is copied")
    spread_slow_hosts: bool = _f(True, "the run's first host ranks the hosts so that those whose access "
                                             "link is half or less of their site's fastest (by its link matrix) "
                                             "are not ring neighbours where it can help it: two slow hosts side "
                                             "by side slow a ring's every exchange (docs/algorithms.md, ring order); not for "
                                             "asynchronous algorithms, nor when off: site, then node id")
    # --- issue 36 ---
    max_world_limit: int = _f(256, "largest --max-world (and --world) a run may have on this daemon: a policy "
                                   "holds dense n x n graphs, and setting a run up is O(n^2) in them")


@dataclass
class SyncConfig:
    """Sync algorithms (peerd/sync). A run's algorithm and graph are `peerd train --algo` and
    `--topology`; the algorithms' options below are the daemon's defaults for its runs."""
    PREFIX: ClassVar[str] = 'sync_'
    SCOPE: ClassVar[str] = 'daemon'
    algorithm: str = _f("hop-backup-skip", "`peerd sim`'s algorithm when none is named (a run's is "
                                           "peerd train --algo): d-psgd, hop, hop-backup, hop-staleness, "
                                           "hop-backup-skip, hop-staleness-skip, aau, netmax, "
                                           "netmax-uniform, netmax-inv, netmax-invsqrt, ad-psgd, sgp")
    topology: str = _f("ring", "`peerd sim`'s graph when none is named (a run's is peerd train --topology): "
                               "ring, torus, complete, exp, exp-directed, aer, links",
                       choices=("ring", "torus", "complete", "exp", "exp-directed", "aer", "links"))
    weighting: str = _f("uniform", "`peerd sim`'s mixing weights: uniform or mh (Metropolis-Hastings)",
                             choices=("uniform", "mh"))
    hop_max_ig: int = _f(4, "Hop: most iterations a sender may run ahead of a receiver (initial tokens per edge)", key='hop_max_ig')
    hop_backup: int = _f(1, "Hop: in-neighbours not waited for in each iteration (backup workers)", key='hop_backup')
    hop_staleness: int = _f(-1, "Hop: staleness bound s in iterations (-1: off)", key='hop_staleness')
    hop_max_skip: int = _f(4, "Hop: most iterations a slow worker skips at once", key='hop_max_skip')
    aau_staleness: int = _f(2, "DSGD-AAU: oldest iteration lag of a non-waited neighbour's model still mixed", key='aau_staleness')
    netmax_gamma: float = _f(0.5, "NetMax: consensus weight of the pulled model", key='netmax_gamma')
    netmax_resolve_frac: float = _f(0.2, "NetMax: relative change of a link estimate that triggers a re-solve", key='netmax_resolve_frac')
    netmax_consensus: float = _f(0.3, "NetMax: weight of the consensus term in the time-to-converge model", key='netmax_consensus')
    netmax_smoothing: float = _f(0.25, "NetMax: share by which a re-solve on new link estimates moves the held "
                                        "peer probabilities (1 = take each solve; a solve that beats the held P "
                                        "by more than netmax_switch_frac is taken at once)", key='netmax_smoothing')
    netmax_switch_frac: float = _f(0.5, "NetMax: a re-solve replaces the held peer probabilities outright when "
                                         "they cost this much more (relative) under the new link estimates", key='netmax_switch_frac')
    netmax_gap_weight: bool = _f(True, "NetMax: a pulled model older than our own is mixed with weight "
                                       "gamma x (its iteration + 1) / (ours + 1), so a fast host is not "
                                       "dragged back by young models (ours, not the paper's)", key='netmax_gap_weight')


@dataclass
class PlanConfig:
    """The runtime model and `peerd plan` (peerd/plan)."""
    PREFIX: ClassVar[str] = 'plan_'
    SCOPE: ClassVar[str] = 'daemon'
    overhead: float = _f(0.0, "seconds per iteration the runtime model adds to every contender "
                                   "(optimizer step, bookkeeping)")
    iterations: int = _f(400, "iterations of the runtime model's max-plus sample path (steady state after 1/4)")
    sim_iterations: int = _f(150, "iterations per worker when the runtime model simulates a contender "
                                       "(Hop with skipping, AAU)")
    backward_fraction: float = _f(0.67, "share of a step that is the backward pass, which DDP overlaps "
                                             "its gradient all-reduce with")
    bucket_bytes: int = _f(25 << 20, "DDP gradient bucket, bytes: the last bucket's all-reduce is never hidden")
    first_bucket_bytes: int = _f(1 << 20, "DDP's first gradient bucket, bytes (torch's default 1 MiB): "
                                                "each bucket is one all-reduce, paying the ring's latencies")
    unshaped_rate: float = _f(1.25e9, "bytes/s the runtime model assumes for a lab pair with no rate "
                                           "(unshaped) or a link nobody measured yet")
    base_latency: float = _f(5e-5, "one-way seconds the runtime model adds to every lab pair (veth, bridge)")
    site_ratio: float = _f(0.25, "hosts whose measured bandwidth is at least this share of the fastest "
                                      "link form one site (hierarchical All-Reduce on a live swarm)")
    default_step_time: float = _f(0.1, "seconds per step `--algo auto` plans with before the trainer "
                                            "measured any")
    change_fraction: float = _f(0.3, "`--algo auto` re-plans when a link's rate or latency or the step "
                                          "time moved by more than this fraction since the last plan")
    interval: float = _f(10.0, "seconds between checks whether `--algo auto` should re-plan")
    tie_fraction: float = _f(0.02, "contenders predicted within this fraction of the fastest are tied; "
                                        "ties go by a fixed preference so every host chooses the same")
    # --- low-communication mode in `peerd plan` (peerd/plan/lowcomm.py; added by the outersim helper) ---
    outer_max_inner_steps: int = _f(500, "`peerd plan`: the largest H (inner steps per DiLoCo round) it recommends "
                                         "(DiLoCo's published H)")
    outer_max_overlap: int = _f(5, "`peerd plan`: the most inner steps of overlap (tau) it recommends between a "
                                   "DiLoCo sync's publish and its mix; beyond it, fragments or a larger H")
    outer_hide_fraction: float = _f(0.05, "`peerd plan`: a DiLoCo row hides its exchange when its time per inner "
                                          "step is within this fraction of its compute-only pace")
    outer_iterations: int = _f(120, "`peerd plan`: syncs of the max-plus sample path of each DiLoCo row")


@dataclass
class LabConfig:
    """The lab: hosts in network namespaces on one machine (peerd lab; peerd/lab)."""
    PREFIX: ClassVar[str] = 'lab_'
    SCOPE: ClassVar[str] = 'lab'
    dir: str = _f("", "directory of `peerd lab` state, secret, logs and daemon data dirs "
                          "(default: <data dir>/lab)")
    daemon_port: int = _f(7070, "port each lab daemon listens on, at its host's address")
    cmd_timeout: float = _f(20.0, "bound on one ip/tc command (or batch) run by the lab, seconds")
    ready_timeout: float = _f(15.0, "seconds a lab delay wire or daemon may take to come up")
    stop_grace: float = _f(3.0, "seconds between SIGTERM and SIGKILL when the lab stops a process")
    queue_ms: float = _f(20.0, "leaf queue of a shaped lab class, in milliseconds at its rate; a class "
                                   "behind a delayed site link holds its round trip's worth more (one BDP)")
    queue_min_bytes: int = _f(131072, "smallest leaf queue of a shaped lab class, bytes "
                                          "(below one 64 KiB GSO packet TCP stalls)")
    control_share: float = _f(0.05, "share of a shaped lab link guaranteed to small control packets")
    tcp_slow_start_after_idle: bool = _f(False, "net.ipv4.tcp_slow_start_after_idle in every lab host's namespace: "
                                                    "off, an idle connection keeps its congestion window (WAN tuning; "
                                                    "otherwise each 1 MB exchange over a 40 ms link restarts from 10 "
                                                    "segments and takes ~6 round trips)")
    tcp_congestion_control: str = _f("cubic", "TCP congestion control of every lab host's namespace (Linux's default, "
                                                   "cubic: this machine defaults to bbr, whose losses in a shallow queue "
                                                   "fed by a faster link cost a gloo all-reduce of 1.1 MB 13 % more); "
                                                   "'' keeps the kernel's default")
    wire_max_bytes: int = _f(64 << 20, "most bytes one lab delay wire holds in flight before dropping")
    churn_stall_slack: float = _f(4.0, "seconds beyond its waits for crashed or restarting neighbours that a live host "
                                       "may go without an iteration under churn (the stall bound of `peerd lab chaos`: "
                                       "one or, with overlapping downtimes, two waits of max(dead_after, "
                                       "train_silent_peer_timeout), plus this)", key='churn_stall_slack')
    churn_readmit_bound: float = _f(45.0, "seconds from a crashed host's daemon restart until it trains and mixes "
                                          "in the run again (`peerd lab chaos` checks it)", key='churn_readmit_bound')
    chaos_down_for: float = _f(3.0, "seconds `peerd lab chaos` keeps a killed host down (keep it above "
                                    "dead_after, so neighbours see the host gone)", key='chaos_down_for')
    chaos_accuracy_margin: float = _f(0.05, "accuracy a run under `peerd lab chaos` may lose against a calm run", key='chaos_accuracy_margin')


@dataclass
class BenchConfig:
    """Heterogeneity benchmarks (peerd bench scenarios; peerd/bench)."""
    PREFIX: ClassVar[str] = 'bench_'
    SCOPE: ClassVar[str] = 'bench'
    gloo_timeout: float = _f(60.0, "seconds a DDP baseline rank waits in a gloo collective or at "
                                         "rendezvous before the run fails")
    master_port: int = _f(29511, "port of the DDP baseline's rendezvous store on the first lab host",
                                scope="bench")
    run_timeout: float = _f(600.0, "bound on one benchmark run (one contender, one seed), seconds",
                                  scope="bench")
    tx_interval: float = _f(0.5, "seconds between samples of each lab host's sent-bytes counter",
                                  scope="bench")
    swarm_timeout: float = _f(180.0, "seconds the lab's daemons may take to list each other as alive",
                                    scope="bench")
    quiet_rate: float = _f(1e6, "bytes/s every lab host must send less than, over bench_quiet_window, "
                                      "before a scenario's first run: the daemons' link warm-up is over",
                                 scope="bench")
    quiet_share: float = _f(0.05, "and less than this share of its own access link's rate (a 10 Mbit "
                                        "host can never send bench_quiet_rate)")
    quiet_window: float = _f(5.0, "seconds of the quiet check (bench_quiet_rate)")
    quiet_timeout: float = _f(240.0, "bound on the wait for a quiet lab; past it the runs start anyway "
                                           "and the scenario's records say so")
    settle_timeout: float = _f(420.0, "bound on the wait, before a scenario's first run, for every daemon's "
                                            "bandwidth probing of every link to reach its steady period (after "
                                            "warm-up, probes come 4, 8, 16, ... s apart: ~2 min at 1 Gbit, ~4.5 min at 10 Mbit); "
                                            "past it the runs start anyway and the records say so; 0: no wait "
                                            "(--quick)")


@dataclass
class ContainerConfig:
    """Container start: link profile and user (peerd container start, peerd/container.py)."""
    PREFIX: ClassVar[str] = ''
    SCOPE: ClassVar[str] = 'container'
    shape_dev: str = _f("eth0", "interface whose egress a container's link profile shapes")
    shape_rate: str = _f("", "rate of everything this container sends, e.g. 50mbit (empty: no limit)",
                         scope="container")
    shape_to: tuple = _f((), "per-destination rates DEST=RATE, comma-separated; DEST a host name, an "
                             "IPv4 address or a CIDR prefix (e.g. peer1=10mbit,172.28.0.0/16=1gbit)",
                         scope="container")
    shape_delay: str = _f("", "delay added to every packet this container sends, e.g. 20ms "
                              "(needs the netem qdisc on the host kernel)")
    shape_strict: bool = _f(False, "a link profile that cannot be applied stops the container "
                                   "instead of starting the daemon unshaped")
    shape_resolve_timeout: float = _f(30.0, "seconds a container waits for the names in shape_to to resolve",
                                      scope="container")
    shape_cmd_timeout: float = _f(20.0, "bound on the tc commands a container runs at start, seconds",
                                  scope="container")
    container_user: str = _f("peerd", "user a container started as root runs peerd as: a name, UID or UID:GID",
                             scope="container")



SECTIONS: dict[str, type] = {
    "node": NodeConfig, "membership": MembershipConfig, "auth": AuthConfig, "mdns": MdnsConfig,
    "links": LinksConfig, "dataplane": DataPlaneConfig, "train": TrainConfig, "sync": SyncConfig,
    "plan": PlanConfig, "lab": LabConfig, "bench": BenchConfig, "container": ContainerConfig,
}


@dataclass(frozen=True)
class Setting:
    """One setting: where it lives (`section`.`attr`) and its flat key (`name`)."""
    name: str            # the flat key: TOML top level, PEERD_<NAME>, --name
    section: str
    attr: str
    field: dataclasses.Field

    @property
    def metadata(self) -> Any:
        return self.field.metadata

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def scope(self) -> str:
        """Which command takes it as a flag: "daemon" (`peerd up`), else only TOML and PEERD_*."""
        return SECTIONS[self.section].SCOPE

    @property
    def help(self) -> str:
        return self.field.metadata["help"]


def _settings() -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f.metadata.get("key") or cls.PREFIX + f.name
            if key in out:
                raise AssertionError(f"two settings with the key {key}")
            out[key] = Setting(key, section, f.name, f)
    return out


FIELDS: dict[str, Setting] = _settings()     # flat key -> setting, in section order
BY_ATTR: dict[tuple[str, str], Setting] = {(s.section, s.attr): s for s in FIELDS.values()}


class Config:
    """All settings, one attribute per section. `Config(train_mix_timeout=90)` and
    `cfg.replace(train_mix_timeout=90)` take flat keys (values as Python values, not parsed)."""

    node: NodeConfig
    membership: MembershipConfig
    auth: AuthConfig
    mdns: MdnsConfig
    links: LinksConfig
    dataplane: DataPlaneConfig
    train: TrainConfig
    sync: SyncConfig
    plan: PlanConfig
    lab: LabConfig
    bench: BenchConfig
    container: ContainerConfig

    def __init__(self, **settings: Any) -> None:
        for name, cls in SECTIONS.items():
            setattr(self, name, cls())
        self._apply(settings)

    def _apply(self, settings: dict[str, Any]) -> None:
        for key, value in settings.items():
            s = FIELDS.get(key)
            if s is None:
                raise TypeError(f"Config: unknown setting {key!r}")
            setattr(getattr(self, s.section), s.attr, value)

    def replace(self, **settings: Any) -> "Config":
        """A copy with the given flat keys changed."""
        new = copy.deepcopy(self)
        new._apply(settings)
        return new

    def get(self, key: str) -> Any:
        """A setting's value by its flat key."""
        s = FIELDS[key]
        return getattr(getattr(self, s.section), s.attr)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        changed = {k: self.get(k) for k, s in FIELDS.items() if self.get(k) != s.default}
        return f"Config({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    @property
    def data_path(self) -> Path:
        return Path(self.node.data_dir or default_data_dir()).expanduser().absolute()

    @property
    def control_socket(self) -> Path:
        return self.data_path / "peerd.sock"


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the setting and the source."""


def _coerce(key: str, value: Any, source: str) -> Any:
    s = FIELDS[key]
    default = s.default
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                    raise ValueError(value)
                return low in {"1", "true", "yes", "on"}
            return bool(value)
        if isinstance(default, tuple):
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            return tuple(str(v) for v in value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            out = float(value)
            if out != out or out < 0 or out == float("inf"):
                raise ValueError(value)
            return out
        out = str(value)
        choices = s.metadata.get("choices")
        if choices and out not in choices:
            raise ValueError(value)
        return out
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{source}: bad value {value!r} for {key} ({s.help})") from None


def _toml_settings(path: Path) -> dict[str, Any]:
    """Flat key -> raw value from a TOML file: `[section]` tables and old top-level flat keys."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for attr, v in value.items():
                s = BY_ATTR.get((name, attr.replace("-", "_")))
                if s is None:
                    raise ConfigError(f"config file {path}: unknown setting {attr!r} in [{name}]"
                                      + _suggest(attr.replace("-", "_")))
                out[s.name] = v
        elif name in FIELDS:
            out[name] = value
        else:
            raise ConfigError(f"config file {path}: unknown setting {key!r}" + _suggest(name))
    return out


def _suggest(name: str) -> str:
    """Where a setting of that name lives now, if one does."""
    hits = [s for s in FIELDS.values() if s.attr == name or s.name == name or s.name.endswith("_" + name)]
    if not hits:
        return ""
    return "; did you mean " + " or ".join(f"[{s.section}] {s.attr}" for s in hits[:3]) + "?"


def load(file: str | os.PathLike | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None) -> Config:
    """Defaults < TOML file < PEERD_* environment < overrides (flags, by flat key); unknown keys are errors."""
    values: dict[str, Any] = {}
    if file:
        path = Path(file)
        for key, value in _toml_settings(path).items():
            values[key] = _coerce(key, value, f"config file {path}")
    env = os.environ if env is None else env
    for key in FIELDS:
        var = f"PEERD_{key.upper()}"
        if var in env and env[var] != "":
            values[key] = _coerce(key, env[var], f"environment {var}")
    for key, value in (overrides or {}).items():
        if value is None or (isinstance(value, tuple) and not value):
            continue
        values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    cfg = Config(**values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    m, links, dp = cfg.membership, cfg.links, cfg.dataplane
    if not m.suspect_after < m.dead_after:
        raise ConfigError(f"suspect_after ({m.suspect_after}) must be below dead_after ({m.dead_after})")
    if m.heartbeat_interval <= 0 or m.heartbeat_interval >= m.suspect_after:
        raise ConfigError(f"heartbeat_interval ({m.heartbeat_interval}) must be >0 and below "
                          f"suspect_after ({m.suspect_after})")
    if not 0 < links.probe_budget < 0.01:
        raise ConfigError(f"link_probe_budget ({links.probe_budget}) must be >0 and below 0.01 (1 %)")
    if not 0 < links.ewma_alpha <= 1:
        raise ConfigError(f"link_ewma_alpha ({links.ewma_alpha}) must be in (0, 1]")
    if not 0 < links.probe_min_bytes <= links.probe_max_bytes:
        raise ConfigError(f"link_probe_min_bytes ({links.probe_min_bytes}) must be >0 and at most "
                          f"link_probe_max_bytes ({links.probe_max_bytes})")
    if not 0 < links.capacity_dip < 1:
        raise ConfigError(f"link_capacity_dip ({links.capacity_dip}) must be in (0, 1)")
    if not 0 <= links.gossip_change < 1:
        raise ConfigError(f"link_gossip_change ({links.gossip_change}) must be in [0, 1)")
    if links.probe_growth_max < 1:
        raise ConfigError(f"link_probe_growth_max ({links.probe_growth_max}) must be >= 1")
    if links.settle_growth <= 1:
        raise ConfigError(f"link_settle_growth ({links.settle_growth}) must be > 1")
    if not 0 < links.capacity_recheck <= 1:
        raise ConfigError(f"link_capacity_recheck ({links.capacity_recheck}) must be in (0, 1]")
    if links.capacity_confirm < 0:
        raise ConfigError(f"link_capacity_confirm ({links.capacity_confirm}) must be >= 0")
    for key in ("link_rtt_interval", "link_bw_interval", "link_probe_seconds", "link_change_fraction",
                "link_capacity_window", "link_gossip_full_interval", "peer_gossip_full_interval",
                "mdns_register_timeout", "mdns_resolve_timeout", "mdns_stop_timeout", "train_budget_interval",
                "bench_quiet_share"):
        if cfg.get(key) <= 0:
            raise ConfigError(f"{key} ({cfg.get(key)}) must be > 0")
    for key in ("mdns_max_resolving", "mdns_max_names", "link_max_entries", "link_gossip_max_entries",
                "link_capacity_samples"):
        if cfg.get(key) < 1:
            raise ConfigError(f"{key} ({cfg.get(key)}) must be >= 1")
    if bool(cfg.node.tls_cert) != bool(cfg.node.tls_key) or bool(cfg.node.tls_cert) != bool(cfg.node.tls_ca):
        raise ConfigError("tls_cert, tls_key and tls_ca go together (this node's certificate from your CA, its key, "
                          "and the CA); without them the cluster secret's CA certifies every node")
    host, sep, port = cfg.node.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"listen: expected HOST:PORT, got {cfg.node.listen!r}")
    if not 0 <= cfg.node.metrics_port < 65536:
        raise ConfigError(f"metrics_port ({cfg.node.metrics_port}) must be within 0..65535 (0: off)")
    if not 4096 <= dp.chunk_bytes <= 64 << 20:
        raise ConfigError(f"dataplane_chunk_bytes ({dp.chunk_bytes}) must be within 4 KiB..64 MiB")
    if not 0 <= cfg.train.attach_wait < dp.stall_timeout:
        raise ConfigError(f"train_attach_wait ({cfg.train.attach_wait}) must be within 0 and "
                          f"dataplane_stall_timeout ({dp.stall_timeout}): the held stream would stall")
    if dp.max_rpcs_per_peer < 1:
        raise ConfigError(f"dataplane_max_rpcs_per_peer ({dp.max_rpcs_per_peer}) must be at least 1")
    if dp.min_rate <= 0:
        raise ConfigError(f"dataplane_min_rate ({dp.min_rate}) must be positive")
    a = cfg.auth
    for key in ("auth_max_concurrent_calls", "auth_max_streams_per_connection", "auth_max_revocations",
                "auth_replay_cache", "gossip_new_candidates", "train_max_world_limit", "auth_plaintext_window"):
        if cfg.get(key) < 1:
            raise ConfigError(f"{key} ({cfg.get(key)}) must be >= 1")
    if not a.max_skew > 0:
        raise ConfigError(f"auth_max_skew ({a.max_skew}) must be > 0")
    n = cfg.node
    if not n.dial_back_timeout > 0:
        raise ConfigError(f"dial_back_timeout ({n.dial_back_timeout}) must be > 0")
    if not 1 <= n.tunnel_spares <= 16:
        raise ConfigError(f"tunnel_spares ({n.tunnel_spares}) must be within 1..16")
    if n.tunnel_retry <= 0:
        raise ConfigError(f"tunnel_retry ({n.tunnel_retry}) must be > 0")
    if n.relay_budget_bytes < 0 or n.relay_max_connections < 1:
        raise ConfigError(f"relay_budget_bytes ({n.relay_budget_bytes}) must be >= 0 and relay_max_connections "
                          f"({n.relay_max_connections}) >= 1")
    if not 4096 <= n.tunnel_chunk_bytes <= 4 << 20:
        raise ConfigError(f"tunnel_chunk_bytes ({n.tunnel_chunk_bytes}) must be within 4 KiB..4 MiB")
    if not 0 <= n.worker_nice <= 19:
        raise ConfigError(f"worker_nice ({n.worker_nice}) must be within 0..19")


def reference() -> str:
    """docs/configuration.md: every setting by section, with its TOML, environment and flag names."""
    lines = ["# Configuration reference", "",
             "Generated from `peerd/config.py` by `peerd config reference` (a test fails when this page is "
             "stale). Precedence, lowest first: the default, the TOML file given with `--config FILE`, the "
             "`PEERD_*` environment variable, the command-line flag. In TOML a setting goes in its section "
             "(`[train]` then `mix_timeout = 90`) or, as before sections existed, at the top level under its "
             "flat key (`train_mix_timeout = 90`). Settings of the daemon's sections are also flags of "
             "`peerd up` (`peerd up --help` shows the common ones, `--help-all` every one); the `lab`, "
             "`bench` and `container` sections are read by `peerd lab`, `peerd bench` and the container "
             "entrypoint from TOML and the environment.", ""]
    for section, cls in SECTIONS.items():
        lines += [f"## [{section}]", "", (cls.__doc__ or "").strip(), "",
                  "| setting | default | environment / flag | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            s = BY_ATTR[(section, f.name)]
            flag = ""
            if s.scope == "daemon":
                flag = "<br>`--" + f.metadata.get("flag", s.name).replace("_", "-") + "`"
            default = f.default
            shown = ",".join(default) if isinstance(default, tuple) else default
            shown = "" if shown == "" else f"`{str(shown).lower() if isinstance(default, bool) else shown}`"
            help_text = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{f.name}` | {shown} | `PEERD_{s.name.upper()}`{flag} | {help_text} |")
        lines.append("")
    return "\n".join(lines)
