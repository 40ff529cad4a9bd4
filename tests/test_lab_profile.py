"""Lab profiles: parsing, and refusals that name the field (no root needed)."""
from __future__ import annotations

import tomllib

import pytest
from click.testing import CliRunner

from cli.lab import lab as lab_cli
from peerd.lab import profile as P

pytestmark = pytest.mark.lab


def parse(text: str, n: int | None = None) -> P.Profile:
    return P.parse(tomllib.loads(text), n)


def test_shipped_profiles_parse_as_described():
    assert set(P.shipped()) >= {"lan", "two-sites", "star", "straggler"}
    lan = P.load("lan")
    assert all(r == 10**9 for r in lan.pair_rates.values()) and len(lan.pair_rates) == 4 * 3
    two = P.load("two-sites")
    assert two.sites == ("a", "b") and two.delay("h1", "h3") == pytest.approx(0.02)
    assert two.delay("h1", "h2") == 0.0 and two.site_links[("b", "a")].rate_bps == 50 * 10**6
    assert two.delayed_sites == ["a", "b"]
    star = P.load("star")
    assert [h.link_bps for h in star.hosts] == [10**7, 10**8, 10**9]
    strag = P.load("straggler")
    assert [h.slowdown for h in strag.hosts] == [4.0, 1.0, 1.0, 1.0]


def test_hosts_flag_overrides_and_pairs_override_defaults():
    p = parse('hosts = 2\n[defaults]\nrate = "1gbit"\n[[pairs]]\nhosts = ["h1", "h3"]\nrate = "10mbit"\n'
              'oneway = true\n', n=3)
    assert len(p.hosts) == 3
    assert p.pair_rates[("h1", "h3")] == 10**7 and p.pair_rates[("h3", "h1")] == 10**9


@pytest.mark.parametrize("rate,bps", [("50mbit", 5 * 10**7), ("1Gbit", 10**9), ("12.5mbps", 10**8),
                                      ("100kbit", 10**5), (2_000_000, 2_000_000)])
def test_rates(rate, bps):
    assert P.parse_rate(rate, "x") == bps


@pytest.mark.parametrize("text,n,field", [
    ('hosts = 2\n[defaults]\nrate = "fast"\n', None, "defaults.rate"),
    ('hosts = 2\n[defaults]\nrate = "1bit"\n', None, "defaults.rate"),
    ('hosts = 2\n[defaults]\nrte = "1gbit"\n', None, "defaults.rte"),
    ('hosts = 2\nbogus = 1\n', None, "bogus"),
    ('hosts = 0\n', None, "hosts"),
    ('hosts = 2\n', 999, "--hosts"),
    ('description = "no count"\n', None, "hosts"),
    ('hosts = 2\n[host.h3]\nlink = "1gbit"\n', None, "host.h3"),
    ('hosts = 2\n[host.h1]\nslowdown = 0.5\n', None, "host.h1.slowdown"),
    ('hosts = 2\n[host.h1]\nlink = "-3mbit"\n', None, "host.h1.link"),
    ('hosts = 3\n[sites.a]\nhosts = ["h1", "h2"]\n', None, "sites"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1", "h9"]\n[sites.b]\nhosts = ["h2"]\n', None, "sites.a.hosts"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h1", "h2"]\n', None, "sites.b.hosts"),
    ('hosts = 2\n[[pairs]]\nhosts = ["h1", "h2"]\nrate = "1gbit"\ndelay = "5ms"\n', None, "pairs[0].delay"),
    ('hosts = 2\n[[pairs]]\nhosts = ["h1", "h2"]\nrate = "1gbit"\nloss = 0.1\n', None, "pairs[0].loss"),
    ('hosts = 2\n[[pairs]]\nhosts = ["h1"]\nrate = "1gbit"\n', None, "pairs[0].hosts"),
    ('hosts = 2\n[[pairs]]\nhosts = ["h1", "h2"]\n', None, "pairs[0].rate"),
    ('hosts = 2\n[[site_links]]\nsites = ["a", "b"]\n', None, "site_links"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\n[[site_links]]\nsites = ["a", "c"]\n',
     None, "site_links[0].sites"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\n[[site_links]]\nsites = ["a", "b"]\n'
     'delay = "20"\n', None, "site_links[0].delay"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\n[[site_links]]\nsites = ["a", "b"]\n'
     'loss = 1.5\n', None, "site_links[0].loss"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\n[[site_links]]\nsites = ["a", "b"]\n'
     '[[site_links]]\nsites = ["b", "a"]\n', None, "site_links[1].sites"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\nnat = true\n[sites.b]\nhosts = ["h2"]\n', None, "sites.a.nat"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1", "h2"]\nnat = true\n', None, "sites.a.nat"),
    ('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\nnat = "yes"\n', None, "sites.b.nat"),
    ('hosts = 2\n[host.h2]\nrelay = true\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\nnat = true\n',
     None, "host.h2.relay"),
])
def test_refusals_name_the_field(text, n, field):
    with pytest.raises(P.ProfileError) as e:
        parse(text, n)
    assert f"{field}:" in str(e.value) or f"{field}." in str(e.value), str(e.value)


def test_cli_refuses_a_bad_profile_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('hosts = 2\n[sites.a]\nhosts = ["h1"]\n[sites.b]\nhosts = ["h2"]\n'
                   '[[site_links]]\nsites = ["a", "b"]\ndelay = "fast"\n')
    res = CliRunner().invoke(lab_cli, ["up", "--profile", str(bad), "--dir", str(tmp_path / "lab")])
    assert res.exit_code != 0
    assert "site_links[0].delay" in res.output and str(bad) in res.output
    assert not (tmp_path / "lab").exists()
    res = CliRunner().invoke(lab_cli, ["up", "--profile", "no-such-profile", "--dir", str(tmp_path / "lab")])
    assert res.exit_code != 0 and "--profile" in res.output


def test_nat_sites_and_relays():
    prof = P.load("three-sites-nat")
    assert prof.nat_sites == ("b", "c") and [h.relay for h in prof.hosts] == [True, False, False]
    assert P.load("two-sites-nat").nat_sites == ("b",) and P.load("two-sites").nat_sites == ()
