"""One Config: every timeout, interval, bound and default of peerd, in one place.

Values come from, lowest precedence first: the defaults below, a TOML file (`--config FILE`,
top-level keys named as the fields), `PEERD_<FIELD>` environment variables, then command-line
flags (`--field-name`). `peerd up --help` lists every field with its default and unit; the CLI
builds those flags from this dataclass, so a new bound added here is documented automatically.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def default_data_dir() -> str:
    """Where `peerd up` and `peerd status` look when --data-dir is not given."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "peerd")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # --- identity and addresses -------------------------------------------------------------
    listen: str = _f("127.0.0.1:7070", "HOST:PORT where the Peer service listens (0.0.0.0 for all interfaces)")
    advertise_address: str = _f("", "HOST:PORT other daemons should dial; default: the listen address, "
                                    "or the source address peers see when listening on 0.0.0.0")
    data_dir: str = _f("", "directory for node id, control socket, checkpoints and logs "
                           "(default: $XDG_DATA_HOME/peerd or ~/.local/share/peerd)")
    run_id: str = _f("default", "training run this daemon belongs to; daemons of other runs are refused")
    peers: tuple[str, ...] = _f((), "seed peer HOST:PORT to contact (repeatable)", flag="peer", multiple=True)
    site: str = _f("", "where this host is (a lab, an office, a cloud region): hosts of one site are ranked "
                       "next to each other in a run, so a ring crosses between sites as few times as it can")
    secret_file: str = _f("", "file holding the cluster secret (or set PEERD_SECRET)")
    tls_cert: str = _f("", "PEM certificate for TLS on the Peer service (optional, for WANs)")
    tls_key: str = _f("", "PEM private key matching --tls-cert")
    tls_ca: str = _f("", "PEM CA bundle that signs every daemon's certificate")
    event_loop: str = _f("auto", "asyncio loop: auto (uvloop when importable), uvloop, asyncio",
                         choices=("auto", "uvloop", "asyncio"))
    log_level: str = _f("info", "log level: debug, info, warning, error")

    # --- membership and failure detection (seconds) ---------------------------------------------
    heartbeat_interval: float = _f(1.0, "seconds between heartbeats to each peer")
    suspect_after: float = _f(3.0, "seconds without direct contact before a peer is suspect")
    dead_after: float = _f(6.0, "seconds without direct contact before a peer is dead")
    rpc_timeout: float = _f(2.0, "deadline of one control-plane RPC to a peer (Hello, Heartbeat, Ping, Leave)")
    connect_retry_max: float = _f(10.0, "longest back-off between attempts to reach an unanswering or dead peer")
    forget_dead_after: float = _f(3600.0, "seconds after which a dead peer is dropped from the table")
    max_peers: int = _f(1024, "most peers kept in the table (gossip beyond this is ignored)")
    peer_gossip_full_interval: float = _f(30.0, "seconds between heartbeats that carry a peer our whole peer "
                                                "table; those between carry only rows that changed")
    leave_timeout: float = _f(1.0, "seconds spent telling peers we leave, at shutdown")
    shutdown_grace: float = _f(1.0, "seconds in-flight RPCs get at shutdown")
    shutdown_timeout: float = _f(4.0, "bound on the whole shutdown after SIGINT/SIGTERM: what is left then "
                                      "(trainer, slots, control socket) is killed or removed at once")

    # --- authentication ---------------------------------------------------------------------
    auth_max_skew: float = _f(30.0, "largest clock difference accepted on an authenticated RPC, seconds")
    auth_replay_cache: int = _f(100_000, "nonces remembered to refuse replays (bounded memory)")
    auth_log_every: float = _f(60.0, "seconds between repeated log lines about one refused source")

    # --- message limits -----------------------------------------------------------------------
    max_control_message_bytes: int = _f(4 * 1024 * 1024, "largest control-plane message accepted, bytes")

    # --- discovery (mDNS / DNS-SD, peerd/net/discovery.py) -----------------------------------
    mdns: bool = _f(True, "announce and browse _peerd._tcp.local. on the local network "
                          "(--no-mdns turns it off; --peer seeds work either way)")
    interface: str = _f("", "interface name(s) or local IP(s), comma-separated, that mDNS binds to; default: "
                            "every interface with IPv4 except those matching mdns_skip_interfaces, "
                            "which are used only when nothing else exists")
    mdns_skip_interfaces: tuple[str, ...] = _f(("lo", "docker*", "br-*", "veth*"),
                                               "interface name patterns mDNS avoids by default (fnmatch)")
    mdns_register_timeout: float = _f(10.0, "seconds to probe for and announce our service name")
    mdns_resolve_timeout: float = _f(3.0, "seconds to resolve one announced service (SRV, TXT, addresses)")
    mdns_stop_timeout: float = _f(2.0, "seconds spent sending the goodbye and closing mDNS at shutdown")
    mdns_max_resolving: int = _f(16, "most announced services resolved concurrently")
    mdns_max_names: int = _f(4096, "most distinct service names tracked (accepted, pending or ignored)")
    mdns_max_txt_bytes: int = _f(1024, "largest TXT record accepted from an announcement, bytes")

    # --- link probes and the link matrix (peerd/net/links.py) ---------------------------------
    link_rtt_interval: float = _f(5.0, "seconds between RTT pings to each peer when no other RTT sample came")
    link_bw_interval: float = _f(60.0, "shortest seconds between bandwidth probes to a peer whose estimate "
                                       "is not refreshed by data-plane traffic (stretched to hold the budget)")
    link_probe_budget: float = _f(0.002, "largest fraction of a link's time bandwidth probes may use "
                                         "at steady state (0.002 = 0.2 %)")
    link_probe_seconds: float = _f(0.2, "target duration of one bandwidth probe at the estimated bandwidth")
    link_probe_rtts: float = _f(8.0, "a bandwidth probe lasts at least this many RTTs, so the RTT is a small error")
    link_probe_min_bytes: int = _f(64 * 1024, "smallest bandwidth probe, bytes (also the first, unsized probe)")
    link_probe_max_bytes: int = _f(64 * 1024 * 1024, "largest bandwidth probe, bytes")
    link_ping_bytes: int = _f(64, "payload of an RTT ping, bytes")
    link_probe_timeout_min: float = _f(5.0, "least deadline of one probe; longer probes get 4x their expected time")
    link_ewma_alpha: float = _f(0.25, "weight of a new sample in the link EWMAs (0 < alpha <= 1)")
    link_change_fraction: float = _f(0.5, "relative deviation of a data-plane sample from the estimate "
                                          "that triggers an early re-probe")
    link_rtt_change_floor: float = _f(0.002, "RTT deviations below this many seconds never trigger a re-probe")
    link_rtt_min_window: float = _f(30.0, "seconds the least RTT seen is kept as the path's base RTT "
                                          "(used to size probes and taken off transfer times)")
    link_min_probe_gap: float = _f(2.0, "least seconds between two probes of one kind to one peer")
    link_warmup_samples: int = _f(3, "bandwidth samples taken link_min_probe_gap apart before the "
                                     "periodic schedule applies")
    link_warmup_gain: float = _f(0.1, "warm-up goes on while a probe twice as big reads more than this fraction faster")
    link_warmup_flat: int = _f(2, "warm-up ends after this many trusted probes in a row that did not read faster")
    link_min_transfer_bytes: int = _f(64 * 1024, "smallest data-plane transfer used as a bandwidth sample, bytes")
    link_min_transfer_seconds: float = _f(0.05, "shortest data-plane transfer (RTT taken off) used as a "
                                                "bandwidth sample, seconds")
    link_retry_max: float = _f(60.0, "longest back-off after failed probes to a peer, seconds")
    link_forget_after: float = _f(900.0, "seconds after which a link estimate nobody refreshed is dropped")
    link_max_entries: int = _f(16384, "most (measurer, target) entries kept in the link matrix")
    link_capacity_window: float = _f(900.0, "seconds a trusted bandwidth sample counts towards the link's capacity "
                                            "(the highest recent sample; the newest one always counts)")
    link_capacity_samples: int = _f(8, "most recent trusted bandwidth samples kept for the capacity figure")
    link_capacity_dip: float = _f(0.2, "a probe reading more than this fraction below the capacity is re-checked")
    link_capacity_recheck: float = _f(0.125, "the first re-check of a low probe comes this fraction of the probe "
                                             "period after it, the next ones link_settle_growth times later each")
    link_capacity_confirm: int = _f(2, "re-checks that must all read low, after a low probe, before the "
                                       "capacity drops to what they read (a real change, not cross traffic)")
    link_probe_growth_max: float = _f(4.0, "after warm-up a probe is at most this many times the size "
                                           "max(link_probe_seconds, link_probe_rtts x RTT) at the capacity")
    link_settle_growth: float = _f(2.0, "after warm-up the gap between bandwidth probes grows by this factor per "
                                        "probe, from 2 x link_min_probe_gap up to the steady period")

    # --- data plane (tensor transfers; peerd/net/dataplane.py) ------------------------------------
    dataplane_chunk_bytes: int = _f(1 << 20, "bytes of tensor data per stream message (1 MiB measured best)")
    dataplane_max_transfer_bytes: int = _f(4 << 30, "largest tensor buffer accepted in one transfer, bytes")
    dataplane_peer_bytes: int = _f(4 << 30, "receive bytes held per peer (in flight or not yet released)")
    dataplane_total_bytes: int = _f(8 << 30, "receive bytes held over all peers")
    dataplane_admit_timeout: float = _f(5.0, "seconds a transfer waits for the byte budget before it is refused")
    dataplane_stall_timeout: float = _f(20.0, "seconds without a stream message before a transfer is aborted")
    dataplane_min_rate: int = _f(1_000_000, "bytes/s below which a transfer is too slow: sets its deadline")
    dataplane_max_rpcs_per_peer: int = _f(4, "data-plane RPCs in flight to (and accepted from) one peer")
    dataplane_max_header_bytes: int = _f(1 << 20, "largest tensor header (the layout) accepted, bytes")
    dataplane_max_tensors: int = _f(1 << 16, "most tensors in one transfer's layout")
    dataplane_pool_bytes: int = _f(4 << 30, "idle receive/scratch buffers kept for reuse, bytes")
    dataplane_deliver_timeout: float = _f(5.0, "seconds a received transfer waits for the daemon to take it")
    dataplane_checksum: str = _f("crc32", "checksum of sent transfers: crc32 or none", choices=("crc32", "none"))
    dataplane_compression: str = _f("none", "cast float32 tensors on the wire: none, fp16 or bf16",
                                    choices=("none", "fp16", "bf16"))
    keepalive_interval: float = _f(10.0, "seconds between gRPC keepalive pings on idle connections")
    keepalive_timeout: float = _f(5.0, "seconds to wait for a keepalive ack before the connection is dead")

    # --- training runs in the daemon (peerd train; peerd/node/training.py) ---------------------
    train_join_timeout: float = _f(60.0, "seconds `peerd train` waits for the run's world to be present")
    train_early_updates: int = _f(64, "peers' updates held when they arrive before this host's run starts")
    train_progress_interval: float = _f(0.5, "seconds between progress records streamed to `peerd train`")
    train_max_restarts: int = _f(5, "times a crashed trainer is restarted from its checkpoint before the run fails")
    train_restart_delay: float = _f(1.0, "seconds before a crashed trainer is restarted")
    train_drain_timeout: float = _f(30.0, "most seconds a finished run keeps serving peers that are still training "
                                          "(it stops as soon as every other host finished or is gone)")
    train_pause_timeout: float = _f(3600.0, "most seconds a trainer stays paused (`peerd ctl pause`) before it "
                                            "resumes by itself")
    train_silent_peer_timeout: float = _f(10.0, "most seconds a host waits on a live neighbour that sends nothing, "
                                                "plus its update's transfer allowance (train_transfer_slack) "
                                                "(then mixes without it until its next update); a crashed or "
                                                "finished trainer is announced at once and not waited for at all")
    train_estimates_interval: float = _f(10.0, "seconds between the link estimates a run feeds to a policy that "
                                               "uses them (NetMax's peer probabilities: a re-solve costs tenths of "
                                               "a second of CPU), from the link matrix and the run's own pulls; the "
                                               "first ones as soon as there are any")
    train_pull_timeout: float = _f(5.0, "most seconds one pull (NetMax, AD-PSGD) may go unanswered (failed, refused, "
                                        "not found, or no reply) before the policy pulls another peer or takes "
                                        "the local step, plus the transfer's allowance (train_transfer_slack); "
                                        "keep it below train_silent_peer_timeout")
    train_budget_interval: float = _f(1.0, "`peerd train --budget swarm`: seconds between counts of the run's "
                                           "iterations over its hosts (one small RPC to each member)")
    train_transfer_slack: float = _f(2.0, "the pull and silent-neighbour bounds grow by this many times the model's "
                                          "expected transfer from that peer (bytes over the measured bandwidth, "
                                          "or over dataplane_min_rate where unmeasured), up to half of "
                                          "train_mix_timeout; 0: fixed bounds")
    train_pull_backoff: float = _f(10.0, "most seconds a peer whose pulls keep failing rests before it is pulled again "
                                         "(the other peers are, or the host steps locally); not for good: a hiccup "
                                         "does not remove a link")
    train_pull_backoff_first: float = _f(1.0, "seconds a peer rests after its first failed pull; doubled per failure "
                                               "in a row up to train_pull_backoff, reset by an answered pull (a peer "
                                               "whose trainer is still starting answers moments later)")

    # --- lab: multi-host testbed on one machine (peerd lab) ------------------------------------
    lab_dir: str = _f("", "directory of `peerd lab` state, secret, logs and daemon data dirs "
                          "(default: <data dir>/lab)", scope="lab")
    lab_daemon_port: int = _f(7070, "port each lab daemon listens on, at its host's address", scope="lab")
    lab_cmd_timeout: float = _f(20.0, "bound on one ip/tc command (or batch) run by the lab, seconds", scope="lab")
    lab_ready_timeout: float = _f(15.0, "seconds a lab delay wire or daemon may take to come up", scope="lab")
    lab_stop_grace: float = _f(3.0, "seconds between SIGTERM and SIGKILL when the lab stops a process", scope="lab")
    lab_queue_ms: float = _f(20.0, "leaf queue of a shaped lab class, in milliseconds at its rate; a class "
                                   "behind a delayed site link holds its round trip's worth more (one BDP)", scope="lab")
    lab_queue_min_bytes: int = _f(131072, "smallest leaf queue of a shaped lab class, bytes "
                                          "(below one 64 KiB GSO packet TCP stalls)", scope="lab")
    lab_control_share: float = _f(0.05, "share of a shaped lab link guaranteed to small control packets", scope="lab")
    lab_tcp_slow_start_after_idle: bool = _f(False, "net.ipv4.tcp_slow_start_after_idle in every lab host's namespace: "
                                                    "off, an idle connection keeps its congestion window (WAN tuning; "
                                                    "otherwise each 1 MB exchange over a 40 ms link restarts from 10 "
                                                    "segments and takes ~6 round trips)", scope="lab")
    lab_tcp_congestion_control: str = _f("cubic", "TCP congestion control of every lab host's namespace (Linux's default, "
                                                   "cubic: this machine defaults to bbr, whose losses in a shallow queue "
                                                   "fed by a faster link cost a gloo all-reduce of 1.1 MB 13 % more); "
                                                   "'' keeps the kernel's default", scope="lab")
    lab_wire_max_bytes: int = _f(64 << 20, "most bytes one lab delay wire holds in flight before dropping", scope="lab")

    # --- sync policy (peerd/sync; read by the daemon and by `peerd sim`) -----------------------
    sync_algorithm: str = _f("hop-backup-skip", "sync algorithm: d-psgd, hop, hop-backup, hop-staleness, "
                                                "hop-backup-skip, hop-staleness-skip, aau, netmax, "
                                                "netmax-uniform, netmax-inv, netmax-invsqrt, ad-psgd, sgp")
    sync_topology: str = _f("ring", "graph: ring, torus, complete, exp, exp-directed, aer, links",
                            choices=("ring", "torus", "complete", "exp", "exp-directed", "aer", "links"))
    sync_weighting: str = _f("uniform", "mixing weights: uniform or mh (Metropolis-Hastings)",
                             choices=("uniform", "mh"))
    hop_max_ig: int = _f(4, "Hop: most iterations a sender may run ahead of a receiver (initial tokens per edge)")
    hop_backup: int = _f(1, "Hop: in-neighbours not waited for in each iteration (backup workers)")
    hop_staleness: int = _f(-1, "Hop: staleness bound s in iterations (-1: off)")
    hop_max_skip: int = _f(4, "Hop: most iterations a slow worker skips at once")
    aau_staleness: int = _f(2, "DSGD-AAU: oldest iteration lag of a non-waited neighbour's model still mixed")
    netmax_gamma: float = _f(0.5, "NetMax: consensus weight of the pulled model")
    netmax_resolve_frac: float = _f(0.2, "NetMax: relative change of a link estimate that triggers a re-solve")
    netmax_consensus: float = _f(0.3, "NetMax: weight of the consensus term in the time-to-converge model")
    netmax_smoothing: float = _f(0.25, "NetMax: share by which a re-solve on new link estimates moves the held "
                                        "peer probabilities (1 = take each solve; a solve that beats the held P "
                                        "by more than netmax_switch_frac is taken at once)")
    netmax_switch_frac: float = _f(0.5, "NetMax: a re-solve replaces the held peer probabilities outright when "
                                         "they cost this much more (relative) under the new link estimates")
    netmax_gap_weight: bool = _f(True, "NetMax: a pulled model older than our own is mixed with weight "
                                       "gamma x (its iteration + 1) / (ours + 1), so a fast host is not "
                                       "dragged back by young models (ours, not the paper's)")

    # --- trainer side (peerd.train) -------------------------------------------------------------
    train_mix_timeout: float = _f(60.0, "seconds a trainer waits for the mixed parameters of one "
                                        "iteration before giving up with an error")

    # --- the daemon's link service and discovery wiring (peerd/node/links_service.py) -----------
    link_gossip_max_entries: int = _f(1024, "most link-matrix entries one heartbeat (or its reply) carries")
    link_probe_jitter: float = _f(2.0, "a bandwidth probe starts after a random delay of up to this many seconds, "
                                       "so hosts do not probe a shared bottleneck in lock-step")
    link_gossip_full_interval: float = _f(30.0, "seconds between heartbeats that carry a peer the whole link "
                                                "matrix; those between carry only the entries that changed")
    link_gossip_change: float = _f(0.1, "relative move of an entry's capacity, throughput or RTT (the RTT also by "
                                        "more than link_rtt_change_floor) that makes it news for the next "
                                        "heartbeats; smaller moves wait for the full gossip")

    # --- container start: link profile and user (peerd container start, peerd/container.py) ----
    shape_dev: str = _f("eth0", "interface whose egress a container's link profile shapes", scope="container")
    shape_rate: str = _f("", "rate of everything this container sends, e.g. 50mbit (empty: no limit)",
                         scope="container")
    shape_to: tuple = _f((), "per-destination rates DEST=RATE, comma-separated; DEST a host name, an "
                             "IPv4 address or a CIDR prefix (e.g. peer1=10mbit,172.28.0.0/16=1gbit)",
                         scope="container")
    shape_delay: str = _f("", "delay added to every packet this container sends, e.g. 20ms "
                              "(needs the netem qdisc on the host kernel)", scope="container")
    shape_strict: bool = _f(False, "a link profile that cannot be applied stops the container "
                                   "instead of starting the daemon unshaped", scope="container")
    shape_resolve_timeout: float = _f(30.0, "seconds a container waits for the names in shape_to to resolve",
                                      scope="container")
    shape_cmd_timeout: float = _f(20.0, "bound on the tc commands a container runs at start, seconds",
                                  scope="container")
    container_user: str = _f("peerd", "user a container started as root runs peerd as: a name, UID or UID:GID",
                             scope="container")

    # --- runtime model and `peerd plan` (peerd/plan) ---------------------------------------------
    plan_overhead: float = _f(0.0, "seconds per iteration the runtime model adds to every contender "
                                   "(optimizer step, bookkeeping)")
    plan_iterations: int = _f(400, "iterations of the runtime model's max-plus sample path (steady state after 1/4)")
    plan_sim_iterations: int = _f(150, "iterations per worker when the runtime model simulates a contender "
                                       "(Hop with skipping, AAU)")
    plan_backward_fraction: float = _f(0.67, "share of a step that is the backward pass, which DDP overlaps "
                                             "its gradient all-reduce with")
    plan_bucket_bytes: int = _f(25 << 20, "DDP gradient bucket, bytes: the last bucket's all-reduce is never hidden")
    plan_first_bucket_bytes: int = _f(1 << 20, "DDP's first gradient bucket, bytes (torch's default 1 MiB): "
                                                "each bucket is one all-reduce, paying the ring's latencies")
    plan_unshaped_rate: float = _f(1.25e9, "bytes/s the runtime model assumes for a lab pair with no rate "
                                           "(unshaped) or a link nobody measured yet")
    plan_base_latency: float = _f(5e-5, "one-way seconds the runtime model adds to every lab pair (veth, bridge)")
    plan_site_ratio: float = _f(0.25, "hosts whose measured bandwidth is at least this share of the fastest "
                                      "link form one site (hierarchical All-Reduce on a live swarm)")
    plan_default_step_time: float = _f(0.1, "seconds per step `--algo auto` plans with before the trainer "
                                            "measured any")
    plan_change_fraction: float = _f(0.3, "`--algo auto` re-plans when a link's rate or latency or the step "
                                          "time moved by more than this fraction since the last plan")
    plan_interval: float = _f(10.0, "seconds between checks whether `--algo auto` should re-plan")
    plan_tie_fraction: float = _f(0.02, "contenders predicted within this fraction of the fastest are tied; "
                                        "ties go by a fixed preference so every host chooses the same")

    # --- churn: leave, crash, join, partitions (issue 8; peerd/node/training.py, peerd/lab/churn.py)
    train_join_pull_timeout: float = _f(10.0, "seconds a host joining a running swarm waits for one neighbour's "
                                        "parameters before trying the next")
    train_join_min_lead: int = _f(4, "iterations the swarm must be ahead of this host's own checkpoint before a "
                                  "joining host starts from a neighbour's parameters instead")
    churn_stall_slack: float = _f(4.0, "seconds beyond dead_after that a live host may go without an iteration "
                                       "while peers crash or leave (the stall bound is dead_after + this)")
    churn_readmit_bound: float = _f(45.0, "seconds from a crashed host's daemon restart until it trains and mixes "
                                          "in the run again (`peerd lab chaos` checks it)")
    chaos_down_for: float = _f(3.0, "seconds `peerd lab chaos` keeps a killed host down (keep it above "
                                    "dead_after, so neighbours see the host gone)")
    chaos_accuracy_margin: float = _f(0.05, "accuracy a run under `peerd lab chaos` may lose against a calm run")

    # --- hostile and broken input (peerd/net/auth.py, peerd/node/training.py) -------------------
    auth_refusal_burst: int = _f(50, "refused calls one (address, claimed node) may cost before it is "
                                     "rate-limited: later calls are refused at once, unverified and unlogged")
    auth_refusal_rate: float = _f(5.0, "refused calls per second one (address, claimed node) earns back")
    auth_max_sources: int = _f(4096, "most (address, claimed node) rate-limit entries and log entries kept; "
                                     "the least recently refused is forgotten first")
    update_max_abs: float = _f(1e6, "largest |value| accepted in a peer's parameters (0: no bound); "
                                    "larger updates are dropped and counted against the peer")
    update_max_norm_ratio: float = _f(100.0, "largest ratio of a peer's parameter norm to our own accepted "
                                             "(0: no bound); larger updates are dropped and counted")
    peer_max_offences: int = _f(5, "bad updates (NaN/Inf, too large, wrong layout) from one peer before it "
                                   "is flagged and its updates ignored for peer_cooldown")
    peer_cooldown: float = _f(30.0, "seconds a flagged peer's updates are ignored before it is re-admitted")
    checkpoint_every: int = _f(25, "iterations between trainer checkpoints (a failed write keeps the "
                                   "previous checkpoint and training goes on)")

    # --- heterogeneity benchmarks (peerd bench scenarios; peerd/bench) -------------------------
    bench_gloo_timeout: float = _f(60.0, "seconds a DDP baseline rank waits in a gloo collective or at "
                                         "rendezvous before the run fails", scope="bench")
    bench_master_port: int = _f(29511, "port of the DDP baseline's rendezvous store on the first lab host",
                                scope="bench")
    bench_run_timeout: float = _f(600.0, "bound on one benchmark run (one contender, one seed), seconds",
                                  scope="bench")
    bench_tx_interval: float = _f(0.5, "seconds between samples of each lab host's sent-bytes counter",
                                  scope="bench")
    bench_swarm_timeout: float = _f(180.0, "seconds the lab's daemons may take to list each other as alive",
                                    scope="bench")
    bench_quiet_rate: float = _f(1e6, "bytes/s every lab host must send less than, over bench_quiet_window, "
                                      "before a scenario's first run: the daemons' link warm-up is over",
                                 scope="bench")
    bench_quiet_share: float = _f(0.05, "and less than this share of its own access link's rate (a 10 Mbit "
                                        "host can never send bench_quiet_rate)", scope="bench")
    bench_quiet_window: float = _f(5.0, "seconds of the quiet check (bench_quiet_rate)", scope="bench")
    bench_quiet_timeout: float = _f(240.0, "bound on the wait for a quiet lab; past it the runs start anyway "
                                           "and the scenario's records say so", scope="bench")
    bench_settle_timeout: float = _f(420.0, "bound on the wait, before a scenario's first run, for every daemon's "
                                            "bandwidth probing of every link to reach its steady period (after "
                                            "warm-up, probes come 4, 8, 16, ... s apart: ~2 min at 1 Gbit, ~4.5 min at 10 Mbit); "
                                            "past it the runs start anyway and the records say so; 0: no wait "
                                            "(--quick)", scope="bench")

    # --- late joiners: a run that admits new hosts (issue 8; peerd/node/joining.py) -------------
    train_max_world: int = _f(0, "hosts a run may grow to by late joiners when `peerd train` gives no "
                                 "--max-world (0: the run's --world, no new host joins)")
    train_join_retry: float = _f(0.5, "seconds a host that wants to join a run waits before asking again "
                                      "(contested rank, a member not answering, the run not found yet)")
    train_coalesce_updates: bool = _f(False, "for Hop's backup and staleness modes, a newer update to a neighbour "
                                             "replaces an older one still waiting in the sender's queue (the "
                                             "receiver takes a neighbour's next update in place of one it never "
                                             "got); off by default until the benchmark matrix is re-run with it "
                                             "(README, ring order)")
    train_spread_slow_hosts: bool = _f(True, "the run's first host ranks the hosts so that those whose access "
                                             "link is half or less of their site's fastest (by its link matrix) "
                                             "are not ring neighbours where it can help it: two slow hosts side "
                                             "by side slow a ring's every exchange (README, ring order); not for "
                                             "asynchronous algorithms, nor when off: site, then node id")

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir or default_data_dir()).expanduser().absolute()

    @property
    def control_socket(self) -> Path:
        return self.data_path / "peerd.sock"

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the field and the source."""


def _coerce(name: str, value: Any, source: str) -> Any:
    f = FIELDS[name]
    default = f.default
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
            return int(value)
        if isinstance(default, float):
            out = float(value)
            if out != out or out < 0:
                raise ValueError(value)
            return out
        out = str(value)
        choices = f.metadata.get("choices")
        if choices and out not in choices:
            raise ValueError(value)
        return out
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: bad value {value!r} for {name} ({f.metadata['help']})") from None


def load(file: str | os.PathLike | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None) -> Config:
    """Defaults < TOML file < PEERD_* environment < overrides (flags); unknown keys are errors."""
    values: dict[str, Any] = {}
    if file:
        path = Path(file)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path}: {e}") from None
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in FIELDS:
                raise ConfigError(f"config file {path}: unknown setting {key!r}")
            values[name] = _coerce(name, value, f"config file {path}")
    env = os.environ if env is None else env
    for name in FIELDS:
        var = f"PEERD_{name.upper()}"
        if var in env and env[var] != "":
            values[name] = _coerce(name, env[var], f"environment {var}")
    for name, value in (overrides or {}).items():
        if value is None or (isinstance(value, tuple) and not value):
            continue
        values[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    cfg = Config(**values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    if not cfg.suspect_after < cfg.dead_after:
        raise ConfigError(f"suspect_after ({cfg.suspect_after}) must be below dead_after ({cfg.dead_after})")
    if cfg.heartbeat_interval <= 0 or cfg.heartbeat_interval >= cfg.suspect_after:
        raise ConfigError(f"heartbeat_interval ({cfg.heartbeat_interval}) must be >0 and below "
                          f"suspect_after ({cfg.suspect_after})")
    if not 0 < cfg.link_probe_budget < 0.01:
        raise ConfigError(f"link_probe_budget ({cfg.link_probe_budget}) must be >0 and below 0.01 (1 %)")
    if not 0 < cfg.link_ewma_alpha <= 1:
        raise ConfigError(f"link_ewma_alpha ({cfg.link_ewma_alpha}) must be in (0, 1]")
    if not 0 < cfg.link_probe_min_bytes <= cfg.link_probe_max_bytes:
        raise ConfigError(f"link_probe_min_bytes ({cfg.link_probe_min_bytes}) must be >0 and at most "
                          f"link_probe_max_bytes ({cfg.link_probe_max_bytes})")
    if not 0 < cfg.link_capacity_dip < 1:
        raise ConfigError(f"link_capacity_dip ({cfg.link_capacity_dip}) must be in (0, 1)")
    if not 0 <= cfg.link_gossip_change < 1:
        raise ConfigError(f"link_gossip_change ({cfg.link_gossip_change}) must be in [0, 1)")
    if cfg.link_probe_growth_max < 1:
        raise ConfigError(f"link_probe_growth_max ({cfg.link_probe_growth_max}) must be >= 1")
    if cfg.link_settle_growth <= 1:
        raise ConfigError(f"link_settle_growth ({cfg.link_settle_growth}) must be > 1")
    if not 0 < cfg.link_capacity_recheck <= 1:
        raise ConfigError(f"link_capacity_recheck ({cfg.link_capacity_recheck}) must be in (0, 1]")
    if cfg.link_capacity_confirm < 0:
        raise ConfigError(f"link_capacity_confirm ({cfg.link_capacity_confirm}) must be >= 0")
    for name in ("link_rtt_interval", "link_bw_interval", "link_probe_seconds", "link_change_fraction",
                 "link_capacity_window", "link_gossip_full_interval", "peer_gossip_full_interval",
                 "mdns_register_timeout", "mdns_resolve_timeout", "mdns_stop_timeout", "train_budget_interval",
                 "bench_quiet_share"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} ({getattr(cfg, name)}) must be > 0")
    for name in ("mdns_max_resolving", "mdns_max_names", "link_max_entries", "link_gossip_max_entries",
                 "link_capacity_samples"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} ({getattr(cfg, name)}) must be >= 1")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key must be given together")
    for addr_field in ("listen",):
        host, sep, port = getattr(cfg, addr_field).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"{addr_field}: expected HOST:PORT, got {getattr(cfg, addr_field)!r}")
    if not 4096 <= cfg.dataplane_chunk_bytes <= 64 << 20:
        raise ConfigError(f"dataplane_chunk_bytes ({cfg.dataplane_chunk_bytes}) must be within 4 KiB..64 MiB")
    if cfg.dataplane_max_rpcs_per_peer < 1:
        raise ConfigError(f"dataplane_max_rpcs_per_peer ({cfg.dataplane_max_rpcs_per_peer}) must be at least 1")
    if cfg.dataplane_min_rate <= 0:
        raise ConfigError(f"dataplane_min_rate ({cfg.dataplane_min_rate}) must be positive")
