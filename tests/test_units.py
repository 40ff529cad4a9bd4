"""Pure units: config precedence and errors, auth, membership rules, generated code freshness."""
from __future__ import annotations

import pytest

from peerd import config
from peerd.net.auth import Authenticator, ReplayCache, SecretError, load_secret
from peerd.net.membership import Membership, State, Timing


# --- config -----------------------------------------------------------------------------------
def test_config_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('heartbeat_interval = 0.5\nrun_id = "from-file"\ndead-after = 9.0\n')
    cfg = config.load(f, env={"PEERD_RUN_ID": "from-env"}, overrides={"dead_after": 7.0})
    assert cfg.heartbeat_interval == 0.5
    assert cfg.run_id == "from-env"
    assert cfg.dead_after == 7.0
    assert config.load(None, env={}).listen == "127.0.0.1:7070"


def test_config_errors_name_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("heartbeat_intervall = 1\n")
    with pytest.raises(config.ConfigError, match="heartbeat_intervall"):
        config.load(f, env={})
    with pytest.raises(config.ConfigError, match="PEERD_DEAD_AFTER"):
        config.load(None, env={"PEERD_DEAD_AFTER": "soon"})
    with pytest.raises(config.ConfigError, match="suspect_after"):
        config.load(None, env={}, overrides={"suspect_after": 10.0, "dead_after": 5.0})
    with pytest.raises(config.ConfigError, match="listen"):
        config.load(None, env={}, overrides={"listen": "nohost"})


def test_every_config_field_has_help_and_a_flag():
    from click.testing import CliRunner

    from cli.main import cli
    out = CliRunner().invoke(cli, ["up", "--help"]).output
    for name, f in config.FIELDS.items():
        assert f.metadata["help"]
        flag = "--" + f.metadata.get("flag", name).replace("_", "-")
        if f.metadata.get("scope", "daemon") == "daemon":
            assert flag in out
        else:
            assert flag not in out  # other commands' settings: TOML and PEERD_* only


# --- auth -------------------------------------------------------------------------------------
def test_auth_roundtrip_and_refusals():
    now = [1000.0]
    a = Authenticator(b"s" * 32, "node-a", max_skew=30, clock=lambda: now[0])
    b = Authenticator(b"s" * 32, "node-b", max_skew=30, clock=lambda: now[0])
    md = a.sign("/m")
    assert b.verify("/m", md) == ("node-a", "")
    assert b.verify("/m", md)[1] == "replayed call"
    assert b.verify("/other", a.sign("/m"))[1] == "cluster secret mismatch"  # bound to the method
    assert Authenticator(b"t" * 32, "c", clock=lambda: now[0]).verify("/m", a.sign("/m"))[1] == \
        "cluster secret mismatch"
    old = a.sign("/m")
    now[0] += 31
    assert "clock skew" in b.verify("/m", old)[1]
    assert b.verify("/m", [])[1].startswith("no credentials")
    tampered = [(k, v if k != "x-peerd-node" else "node-z") for k, v in a.sign("/m")]
    assert b.verify("/m", tampered)[1] == "cluster secret mismatch"


def test_reply_mac_proves_the_server_holds_the_secret():
    a = Authenticator(b"s" * 32, "client")
    server = Authenticator(b"s" * 32, "server")
    impostor = Authenticator(b"x" * 32, "server")
    assert a.verify_reply("server", "n1", server.reply_mac("n1"))
    assert not a.verify_reply("server", "n1", impostor.reply_mac("n1"))
    assert not a.verify_reply("server", "n2", server.reply_mac("n1"))
    assert not a.verify_reply("server", "n1", None)


def test_replay_cache_is_bounded():
    c = ReplayCache(capacity=100, window=10)
    for i in range(1000):
        assert c.check_and_add(f"n{i}", now=0.0)
    assert len(c._seen) <= 100


def test_load_secret(tmp_path, monkeypatch):
    with pytest.raises(SecretError, match="no cluster secret"):
        load_secret("", env={})
    with pytest.raises(SecretError, match="at least 16"):
        load_secret("", env={"PEERD_SECRET": "short"})
    p = tmp_path / "s"
    p.write_text("  0123456789abcdef0123  \n")
    assert load_secret(str(p), env={}) == b"0123456789abcdef0123"
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), env={})


# --- membership -------------------------------------------------------------------------------
def make(**kw) -> Membership:
    return Membership("me", Timing(suspect_after=3, dead_after=6, forget_dead_after=100,
                                   retry_base=1, retry_max=8, **kw))


def test_failure_detector_suspect_dead_forget_and_readmit():
    m = make()
    m.admit("p", "h:1", "r", 1, {}, now=0)
    assert m.tick(2.9) == []
    [t] = m.tick(3.0)
    assert (t.old, t.new) == (State.ALIVE, State.SUSPECT)
    [t] = m.tick(6.0)
    assert t.new is State.DEAD
    assert [x.node_id for x in m.to_contact(6.0)] == ["p"]  # dead peers are still tried
    m.contact_failed("p", 6.0)
    assert m.to_contact(6.5) == []                           # ... with back-off
    t = m.heard_from("p", 7.0, incarnation=2)
    assert t.new is State.ALIVE and m.get("p").incarnation == 2
    m.tick(7.0)
    m.members["p"].state, m.members["p"].state_since = State.DEAD, 7.0
    [t] = m.tick(107.0)
    assert t.new is None and m.get("p") is None


def test_gossip_never_makes_a_peer_alive_only_a_candidate():
    m = make()
    m.merge_gossip([{"node_id": "q", "address": "h:2", "incarnation": 1, "state": State.ALIVE},
                    {"node_id": "me", "address": "h:0", "incarnation": 1, "state": State.ALIVE},
                    {"node_id": "z", "address": "h:3", "incarnation": 1, "state": State.DEAD}], now=0)
    assert m.members == {}
    assert list(m.candidates) == ["h:2"]
    m.admit("q", "h:2", "r", 1, {}, now=1)
    assert m.alive() == ["q"] and m.candidates == {}


def test_old_incarnation_never_overwrites_newer():
    m = make()
    m.admit("p", "h:1", "r", 5, {}, now=0)
    assert m.admit("p", "h:9", "r", 4, {}, now=1) is None
    assert m.get("p").address == "h:1"
    assert m.heard_from("p", 2, incarnation=3) is None


def test_left_peer_is_not_contacted_until_a_newer_incarnation_shows_up():
    m = make()
    m.admit("p", "h:1", "r", 1, {}, now=0)
    assert m.left("p", 1, now=1).new is State.LEFT
    assert m.to_contact(2) == []
    m.merge_gossip([{"node_id": "p", "address": "h:1", "incarnation": 2, "state": State.ALIVE}], now=3)
    assert "h:1" in m.candidates


def test_peer_table_gossip_sends_news_and_the_whole_table_when_due():
    m = make(full_interval=30)
    for i, p in enumerate("pqr"):
        m.admit(p, f"h:{i}", "r", 1, {}, now=0)
    names = lambda rows: sorted(x.node_id for x in rows)  # noqa: E731
    # Never delivered to p: the whole table, less p's own row.
    rows, mark = m.gossip_rows("p", "hb", now=1)
    assert names(rows) == ["q", "r"] and mark.full
    again, _ = m.gossip_rows("p", "hb", now=1.5)
    assert names(again) == ["q", "r"]                        # not delivered yet: still whole
    m.gossiped("p", "hb", mark)
    assert m.gossip_rows("p", "hb", now=2)[0] == []           # nothing new
    # A state change is news, once; a refresh of liveness is not.
    m.heard_from("q", 2.5)
    m.tick(4.0)                                               # q, r silent since 0 and 2.5: q alive, r suspect
    rows, mark = m.gossip_rows("p", "hb", now=4)
    assert names(rows) == ["r"] and not mark.full
    m.gossiped("p", "hb", mark)
    assert m.gossip_rows("p", "hb", now=5)[0] == []
    # Ways are separate: the reply way to p has had nothing yet.
    assert names(m.gossip_rows("p", "reply", now=5)[0]) == ["q", "r"]
    # A new member is news to everyone who had the table.
    m.admit("s", "h:9", "r", 1, {}, now=6)
    rows, mark = m.gossip_rows("p", "hb", now=6)
    assert names(rows) == ["s"]
    m.gossiped("p", "hb", mark)
    # The whole table again once full_interval has passed since the last full one (at 1.5).
    assert m.gossip_rows("p", "hb", now=31)[0] == []
    rows, mark = m.gossip_rows("p", "hb", now=31.5)
    assert names(rows) == ["q", "r", "s"] and mark.full
    m.gossiped("p", "hb", mark)
    # A restarted p (new incarnation) knows nothing: its next table is whole.
    m.heard_from("p", 32, incarnation=2)
    assert names(m.gossip_rows("p", "hb", now=33)[0]) == ["q", "r", "s"]
    m.admit("p", "h:0", "r", 3, {}, now=34)
    assert names(m.gossip_rows("p", "hb", now=35)[0]) == ["q", "r", "s"]


def test_seed_candidates_are_retried_forever_with_bounded_backoff():
    m = make()
    m.add_candidate("seed:1", "seed", 0, permanent=True)
    for i in range(20):
        m.candidate_failed("seed:1", float(i))
    c = m.candidates["seed:1"]
    assert c.next_attempt - 19 <= 8  # retry_max


# --- generated code ---------------------------------------------------------------------------
def test_generated_protobuf_code_is_up_to_date():
    from peerd import protogen
    stale = protogen.check()
    assert stale == [], f"generated code is stale, run `make proto`: {stale}"
