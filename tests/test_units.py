"""Pure units: config precedence and errors, auth, membership rules, generated code freshness."""
from __future__ import annotations

import pytest

from peerd import config
from peerd.net.auth import SecretError, load_secret
from peerd.net.membership import Membership, State, Timing


# --- config -----------------------------------------------------------------------------------
def test_config_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('heartbeat_interval = 0.5\nrun_id = "from-file"\ndead-after = 9.0\n')
    cfg = config.load(f, env={"PEERD_RUN_ID": "from-env"}, overrides={"dead_after": 7.0})
    assert cfg.membership.heartbeat_interval == 0.5
    assert cfg.node.run_id == "from-env"
    assert cfg.membership.dead_after == 7.0
    assert config.load(None, env={}).node.listen == "127.0.0.1:7070"


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
    """`peerd up --help` is a screenful of the common flags; --help-all lists every daemon setting."""
    from click.testing import CliRunner

    from cli.main import cli
    short = CliRunner().invoke(cli, ["up", "--help"]).output
    out = CliRunner().invoke(cli, ["up", "--help-all"]).output
    assert len(short.splitlines()) <= 60 and "--listen" in short and "--peer" in short
    assert "--train-mix-timeout" not in short and "--help-all" in short
    for name, f in config.FIELDS.items():
        assert f.metadata["help"]
        flag = "--" + f.metadata.get("flag", name).replace("_", "-")
        if f.scope == "daemon":
            assert flag in out
            assert (flag in short) == bool(f.metadata.get("common"))
        else:
            assert flag not in out  # other commands' settings: TOML and PEERD_* only


def test_config_sections_and_the_flat_keys_from_before_them(tmp_path):
    """A TOML file in sections and one with the old top-level keys give the same Config; a key in
    the wrong section, or an unknown one, is an error that names where it lives."""
    sections, flat = tmp_path / "s.toml", tmp_path / "f.toml"
    sections.write_text('[train]\nmix_timeout = 90\n[sync]\nhop_max_ig = 3\n[mdns]\nenabled = false\n'
                        '[links]\nprobe-budget = 0.001\n')
    flat.write_text('train_mix_timeout = 90\nhop_max_ig = 3\nmdns = false\nlink_probe_budget = 0.001\n')
    a, b = config.load(sections, env={}), config.load(flat, env={})
    assert a == b and a.train.mix_timeout == 90.0 and a.sync.hop_max_ig == 3 and a.mdns.enabled is False
    assert config.load(flat, env={"PEERD_TRAIN_MIX_TIMEOUT": "5"}).train.mix_timeout == 5.0
    wrong = tmp_path / "w.toml"
    wrong.write_text("[train]\nhop_max_ig = 3\n")
    with pytest.raises(config.ConfigError, match=r"\[sync\] hop_max_ig"):
        config.load(wrong, env={})
    wrong.write_text("mix_timeout = 3\n")
    with pytest.raises(config.ConfigError, match=r"\[train\] mix_timeout"):
        config.load(wrong, env={})
    assert config.Config(train_mix_timeout=7).replace(hop_max_ig=9).get("hop_max_ig") == 9
    with pytest.raises(TypeError, match="nonsense"):
        config.Config(nonsense=1)


def test_config_show_round_trips_through_toml(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli
    f = tmp_path / "c.toml"
    f.write_text("train_mix_timeout = 90\npeers = ['a:1', 'b:2']\n")
    out = CliRunner().invoke(cli, ["config", "show", "--config", str(f)], env={}).output
    g = tmp_path / "g.toml"
    g.write_text(out)
    assert config.load(g, env={}) == config.load(f, env={})
    assert "[train]" in out and "mix_timeout = 90.0" in out


def test_configuration_reference_is_current():
    """docs/configuration.md is `peerd config reference`: regenerate it when a setting changes."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert page.read_text() == config.reference() + "\n", \
        "docs/configuration.md is stale: run `peerd config reference > docs/configuration.md`"


# --- auth (the signatures themselves: tests/test_security_auth.py) -------------------------------
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


def test_a_goodbye_is_not_undone_by_contact_sent_before_it():
    """Its last heartbeat or data frame, on another stream, may be processed after the Leave: the
    peer stays "left" (a daemon's partner saw it alive again, then dead, never left). A restart
    (newer incarnation) is back."""
    m = make()
    m.admit("p", "h:1", "r", 1, {}, now=0)
    m.left("p", 1, now=1)
    assert m.heard_from("p", 2, incarnation=1) is None and m.heard_from("p", 2) is None
    assert m.get("p").state is State.LEFT
    assert m.heard_from("p", 3, incarnation=2).new is State.ALIVE


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


def test_a_seed_not_adopted_is_kept_retried_with_back_off_and_says_why():
    """A seed in another run (or of an old protocol) stays a seed, unlike a gossiped address, and
    `peerd status` shows why it is not a peer; it used to be retried at every membership tick."""
    m = make()
    m.add_candidate("seed:1", "seed", 0, permanent=True)
    m.add_candidate("gossip:1", "gossip", 0)
    m.drop_candidate("gossip:1", 1.0, "not adopted: another run")
    m.drop_candidate("seed:1", 1.0, "not adopted: another run")
    c = m.candidates["seed:1"]
    assert "gossip:1" not in m.candidates and c.next_attempt > 1.0
    assert (c.failures, c.last_error) == (1, "not adopted: another run")
    m.admit("n1", "seed:1", "r", 1, {}, now=2.0)
    assert (c.node_id, c.failures, c.last_error) == ("n1", 0, "")


# --- generated code ---------------------------------------------------------------------------
def test_generated_protobuf_code_is_up_to_date():
    from peerd import protogen
    stale = protogen.check()
    assert stale == [], f"generated code is stale, run `make proto`: {stale}"
