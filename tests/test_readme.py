"""The README's commands run as written, as far as one machine allows; the docs' links resolve.

Every fenced block of README.md carries a marker on the line right before it, `<!-- test: KIND -->`,
and this module checks each block by its kind:

- `make`: each `make TARGET` names a target of the Makefile. Not run (`make demo` and `make test`
  take minutes; this suite is what `make test` runs).
- `run`: the block runs in bash (`set -e`) from the repository root with `.venv/bin` on the PATH
  and a temporary HOME, and must exit 0.
- `parse`: each `peerd ...` command (a leading `sudo` dropped) is parsed by the real click commands,
  so a renamed command or option fails; not run (the lab needs root and minutes).
- `compose`: `peerd` commands are parsed as above; each `docker compose` command's files are
  merged and interpolated by the real Compose v2 binary (`config`, with the command's variables),
  its subcommand and options must exist, and `exec SERVICE peerd ...` must name a service and a
  valid peerd command. No Docker Engine runs here.
- `same-as PATH`: the block is PATH's text (a module docstring dropped).
- `hosts`: a block for several machines, run as several hosts on this one. Comment lines start
  sections: `# every host...`, `# once, on host X...`, `# host X (ADDRESS)...`. Each host is one
  bash session that lives through the whole README, started in the repository root, so a later
  block runs on the daemons an earlier one started, as on real machines. Consecutive `# host`
  sections run concurrently (the machines work at the same time); `every host` runs on each
  concurrently, `once` on one host. What differs from real machines, and only this:
    * host addresses: each host gets a free loopback port P; `ADDRESS:PORT` of a host becomes
      `127.0.0.1:P` of that host, and `0.0.0.0:PORT` in a host's own section becomes its own
      `127.0.0.1:P` (two daemons cannot both listen on 0.0.0.0:7070 of one machine);
    * every host has its own PEERD_DATA_DIR (a real host has its own home) and all share one
      temporary HOME, so a file the README says to copy to every host is already there;
    * `make TARGET && ...` checks TARGET as for `make` blocks and runs the rest (the venv exists);
      `.venv/bin` is not on the hosts' PATH, so the README's own activation is what puts peerd there.
  A section that fails (a command's non-zero exit stops it, `set -e`) or outlasts STEP_TIMEOUT
  fails the test with each host's output and its daemon's logs.

It also checks that README.md has at most README_MAX_LINES lines, that every fenced block in it is
marked, that every relative link (and #anchor) in README.md and docs/*.md resolves, and that the
`peerd` commands in the shell blocks of the docs pages parse.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

from cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
STEP_TIMEOUT = 300.0       # one section on every host: a 300-iteration run takes 7-60 s here
RUN_TIMEOUT = 120.0        # one `run` block
STOP_TIMEOUT = 15.0        # hosts' daemons after SIGTERM (each stops within shutdown_timeout, 4 s)
# Pages other people write; a link to one is skipped (and named) only while the page is missing.
PAGES_OF_OTHERS = ("docs/configuration.md", "docs/docker.md", "docs/real-size.md", "docs/security.md")
# Pages whose shell blocks are checked elsewhere or are not commands of ours.
NOT_PARSED = {"ARCHITECTURE.md", *(Path(p).name for p in PAGES_OF_OTHERS)}
KINDS = {"make", "run", "parse", "compose", "same-as", "hosts"}

MARKER = re.compile(r"^<!--\s*test:\s*(\S+)(?:\s+(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Block:
    kind: str | None          # None: no marker
    arg: str
    lang: str
    text: str
    line: int                 # 1-based line of the opening fence

    def where(self) -> str:
        return f"README.md:{self.line} ({self.kind or 'unmarked'} block)"


def blocks(text: str) -> list[Block]:
    """Every fenced block with the marker on the line right before its fence, if any."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"unclosed fence at line {start + 1}"
        mark = MARKER.match(lines[start - 1]) if start > 0 else None
        out.append(Block(mark.group(1) if mark else None, (mark.group(2) or "") if mark else "", m.group(1),
                         "\n".join(body) + "\n", start + 1))
        i += 1
    return out


def readme_blocks(kind: str | None = None) -> list[Block]:
    found = blocks(README.read_text())
    return [b for b in found if kind is None or b.kind == kind]


def commands(text: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [re.sub(r"\s+#[^'\"]*$", "", ln).strip() for ln in joined.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def check_make(line: str) -> str:
    """`make T...` or `make T... && REST`: the targets exist; returns REST ('' for none)."""
    m = re.fullmatch(r"make((?:\s+[A-Za-z0-9_.-]+)+)\s*(?:&&\s*(.*))?", line)
    assert m, f"not a make command: {line!r}"
    missing = set(m.group(1).split()) - make_targets()
    assert not missing, f"`{line}`: no Makefile target {sorted(missing)}"
    return m.group(2) or ""


def parse_peerd(argv: list[str], tolerate_missing_paths: bool = False) -> click.Command:
    """Parse `peerd ARGV` with the real click commands, without running it; a bad name or option
    raises. `--` and what follows go to the command as arguments; a following `peerd ...` (as in
    `peerd lab exec h1 -- peerd peers`) is parsed too."""
    if argv in (["--version"], ["-V"], ["--help"], ["-h"]):
        return cli
    cmd: click.Command = cli
    args = list(argv)
    while isinstance(cmd, click.Group):
        if (not args or args[0].startswith("-")) and cmd.invoke_without_command:
            break                          # a group that runs by itself (`peerd plan --profile ...`)
        assert args and not args[0].startswith("-"), f"`peerd {shlex.join(argv)}` names no subcommand"
        sub = cmd.get_command(click.Context(cmd), args[0])
        assert sub is not None, f"`peerd {shlex.join(argv)}`: no command {args[0]!r}"
        cmd, args = sub, args[1:]
    try:
        cmd.make_context(cmd.name, list(args))
    except click.BadParameter as e:
        path_missing = isinstance(e.param, click.Parameter) and isinstance(e.param.type, click.Path) \
            and "does not exist" in str(e.message)
        if not (tolerate_missing_paths and path_missing):
            raise AssertionError(f"`peerd {shlex.join(argv)}`: {e.format_message()}") from None
    except click.UsageError as e:
        raise AssertionError(f"`peerd {shlex.join(argv)}`: {e.format_message()}") from None
    if "--" in args:
        rest = args[args.index("--") + 1:]
        if rest[:1] == ["peerd"]:
            parse_peerd(rest[1:], tolerate_missing_paths)
    return cmd


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        k, _, v = argv[0].partition("=")
        env[k] = v
        argv = argv[1:]
    return env, argv


def peerd_argv(line: str) -> list[str] | None:
    """argv after `peerd` of a shell command line (variables and `sudo` dropped), else None."""
    _, argv = split_env(shlex.split(line, comments=True))
    for i, tok in enumerate(argv):            # a background `&`, a redirection or a pipe ends it
        if tok in ("&", "|") or re.fullmatch(r"\d?>>?.*|<.*", tok):
            argv = argv[:i]
            break
    if argv[:1] == ["sudo"]:
        argv = argv[1:]
    return argv[1:] if argv[:1] in (["peerd"], [".venv/bin/peerd"]) else None


# --- the README as a whole ---------------------------------------------------------------------

def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (move detail to docs/)"


def test_every_readme_block_is_marked_with_a_known_kind():
    found = readme_blocks()
    assert found, "no fenced blocks in README.md"
    for b in found:
        assert b.kind in KINDS, f"{b.where()}: mark it with <!-- test: KIND --> on the line before, KIND in {KINDS}"
    kinds = {b.kind for b in found}
    assert {"make", "hosts", "same-as"} <= kinds, kinds


def test_make_blocks_name_makefile_targets():
    found = readme_blocks("make")
    assert found
    for b in found:
        lines = commands(b.text)
        assert lines, b.where()
        for line in lines:
            assert check_make(line) == "", f"{b.where()}: a make block holds make commands only: {line!r}"
    # The quick start's two commands, as the task promises: both set up what they need.
    assert {"demo", "test"} <= make_targets()


def test_make_check_can_fail():
    with pytest.raises(AssertionError, match="no Makefile target"):
        check_make("make no-such-target-here")


def test_same_as_blocks_match_their_files():
    found = readme_blocks("same-as")
    assert found
    for b in found:
        path = ROOT / b.arg
        assert b.arg and path.is_file(), f"{b.where()}: no file {b.arg!r}"
        text = path.read_text()
        if text.lstrip().startswith('"""'):
            text = text.split('"""', 2)[2]
        assert b.text.strip() == text.strip(), f"{b.where()} differs from {b.arg}"


def test_run_blocks_run(tmp_path):
    found = readme_blocks("run")
    assert found
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEERD_")}
    env.update(HOME=str(tmp_path), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    for b in found:
        p = subprocess.run(["bash", "-e", "-c", b.text], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=RUN_TIMEOUT)
        assert p.returncode == 0, f"{b.where()} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        assert p.stdout.strip(), f"{b.where()} printed nothing"


def test_parse_blocks_parse():
    found = readme_blocks("parse")
    for b in found:
        for line in commands(b.text):
            argv = peerd_argv(line)
            assert argv is not None, f"{b.where()}: a parse block holds peerd commands only: {line!r}"
            parse_peerd(argv)


def test_peerd_parse_can_fail():
    with pytest.raises(AssertionError, match="(?i)no such option"):
        parse_peerd(["up", "--no-such-flag"])
    with pytest.raises(AssertionError, match="no command"):
        parse_peerd(["lab", "exec", "h1", "--", "peerd", "no-such-command"])


def test_compose_blocks_against_the_compose_files():
    from tests.docker_files import compose, resolved

    found = readme_blocks("compose")
    for b in found:
        for line in commands(b.text):
            env, argv = split_env(shlex.split(line, comments=True))
            if argv[:1] == ["peerd"]:
                parse_peerd(argv[1:], tolerate_missing_paths=True)
                continue
            assert argv[:2] == ["docker", "compose"], f"{b.where()}: {line!r}"
            files, profiles, rest = [], [], argv[2:]
            while rest and rest[0] in ("-f", "--file", "--profile"):
                (files if rest[0] != "--profile" else profiles).append(rest[1])
                rest = rest[2:]
            assert files and rest, f"{b.where()}: {line!r} names no file or no subcommand"
            for f in files:
                assert (ROOT / f).is_file(), f"{b.where()}: no compose file {f}"
            model = resolved(files, profiles, env)
            sub, args = rest[0], rest[1:]
            helptext = compose(files, profiles, args=[sub, "--help"], env=env)
            assert helptext.returncode == 0, f"{b.where()}: `docker compose {sub}`: {helptext.stderr}"
            for a in args:
                if a.startswith("-"):
                    flag = a.split("=")[0]
                    assert re.search(rf"(^|[\s,]){re.escape(flag)}\b", helptext.stdout), \
                        f"{b.where()}: `docker compose {sub}` has no option {flag}"
            if sub == "exec":
                positional = [a for a in args if not a.startswith("-")]
                service, command = positional[0], positional[1:]
                assert service in model["services"], f"{b.where()}: no service {service!r}"
                if command[:1] == ["peerd"]:
                    parse_peerd(command[1:])


# --- several hosts on one machine ----------------------------------------------------------------

HEADER_EVERY = re.compile(r"^#\s*every host\b", re.I)
HEADER_ONCE = re.compile(r"^#\s*once,? on host (\w+)\b", re.I)
HEADER_HOST = re.compile(r"^#\s*host (\w+) \(([^)\s]+)\)", re.I)
ADDRESS = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3}):(\d+)\b")


@dataclass
class Section:
    host: str | None          # None: every host
    once: bool = False        # `# once, on host X`: a step of its own
    lines: list[str] = field(default_factory=list)


def declared_hosts(text: str) -> dict[str, str]:
    """name -> address of every `# host X (ADDRESS)` header in the README's hosts blocks."""
    out = {}
    for b in blocks(text):
        if b.kind == "hosts":
            for ln in b.text.splitlines():
                m = HEADER_HOST.match(ln.strip())
                if m:
                    assert out.get(m.group(1), m.group(2)) == m.group(2), f"host {m.group(1)} has two addresses"
                    out[m.group(1)] = m.group(2)
    return out


def sections(b: Block) -> list[Section]:
    out: list[Section] = []
    for raw in b.text.splitlines():
        ln = raw.strip()
        if not ln:
            continue
        if ln.startswith("#"):
            if HEADER_EVERY.match(ln):
                out.append(Section(None))
            elif m := HEADER_ONCE.match(ln):
                out.append(Section(m.group(1), once=True))
            elif m := HEADER_HOST.match(ln):
                out.append(Section(m.group(1)))
            continue                       # any other comment is prose
        assert out, f"{b.where()}: command {ln!r} before any '# every host' / '# host X (ADDRESS)' header"
        out[-1].lines.append(raw)
    return out


def steps(secs: list[Section], hosts: list[str]) -> list[dict[str, list[str]]]:
    """Sections grouped into steps run concurrently: consecutive per-host sections for distinct
    hosts form one step; `every host` and `once` sections are steps of their own."""
    out: list[dict[str, list[str]]] = []
    joinable = False
    for s in secs:
        if s.host is None:
            out.append({h: list(s.lines) for h in hosts})
            joinable = False
        elif joinable and not s.once and s.host not in out[-1]:
            out[-1][s.host] = list(s.lines)
        else:
            out.append({s.host: list(s.lines)})
            joinable = not s.once
    return out


def rewrite(line: str, host: str, ports: dict[str, int], addresses: dict[str, str]) -> str:
    """The documented address rule: another host's ADDRESS:PORT and this host's 0.0.0.0:PORT
    become the loopback address of that host."""
    by_address = {a: h for h, a in addresses.items()}

    def sub(m: re.Match) -> str:
        target = host if m.group(1) == "0.0.0.0" else by_address.get(m.group(1))
        return f"127.0.0.1:{ports[target]}" if target else m.group(0)
    return ADDRESS.sub(sub, line)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Host:
    """One machine: a bash session that lives through the README, with its own data dir."""

    def __init__(self, name: str, work: Path, home: Path) -> None:
        self.name, self.work = name, work
        self.data_dir = work / f"data-{name}"
        self.log_path = work / f"host-{name}.log"
        venv_bin = str(Path(sys.executable).parent)
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                               if p and Path(p).resolve() != Path(venv_bin).resolve())
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PEERD_") and k not in ("VIRTUAL_ENV", "XDG_DATA_HOME", "PYTHONHOME")}
        env.update(HOME=str(home), PATH=path, PEERD_DATA_DIR=str(self.data_dir))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True,
                                     start_new_session=True)
        self.steps = 0

    def start(self, lines: list[str]) -> Path:
        """Source `lines` in the session (stdin /dev/null, `set -e`); returns the file its status lands in."""
        self.steps += 1
        script = self.work / f"step{self.steps}-{self.name}.sh"
        rc = self.work / f"step{self.steps}-{self.name}.rc"
        script.write_text("set -e\n" + "\n".join(lines) + "\nset +e\n")
        self.proc.stdin.write(f"echo '>>> step {self.steps}'; source {shlex.quote(str(script))} </dev/null; "
                              f"echo $? > {shlex.quote(str(rc))}\n")
        self.proc.stdin.flush()
        return rc

    def output(self, lines: int = 60) -> str:
        parts = [f"----- host {self.name}: its shell (last {lines} lines) -----",
                 *self.log_path.read_text(errors="replace").splitlines()[-lines:]]
        for log in sorted(self.data_dir.glob("*.log")):
            parts += [f"----- host {self.name}: {log.name} -----", *log.read_text(errors="replace").splitlines()[-25:]]
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM to the session's process group (the daemons say goodbye), SIGKILL after STOP_TIMEOUT."""
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        self.proc.wait(timeout=10)
        self._log.close()

    def _group_alive(self) -> bool:
        self.proc.poll()                   # reap the shell: a zombie still counts as a group member
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False


def run_step(step: dict[str, list[str]], hosts: dict[str, Host], where: str) -> None:
    pending = {name: hosts[name].start(lines) for name, lines in step.items()}
    started = time.monotonic()
    deadline = started + STEP_TIMEOUT
    failed = None
    while pending and failed is None:
        for name, rc in list(pending.items()):
            if rc.exists() and rc.read_text().strip():
                code = int(rc.read_text())
                if code != 0:
                    failed = f"host {name} exited {code}"
                del pending[name]
            elif hosts[name].proc.poll() is not None:
                failed = f"a command on host {name} failed (its shell exited {hosts[name].proc.returncode})"
        if time.monotonic() > deadline:
            failed = f"hosts {sorted(pending)} still running after {STEP_TIMEOUT:g} s"
        time.sleep(0.2)
    print(f"{where}: {time.monotonic() - started:.1f} s on hosts {sorted(step)}")
    if failed:
        text = "\n".join(f"--- host {n}:\n" + "\n".join(ls) for n, ls in step.items())
        pytest.fail(f"{where}: {failed}\nthe step, as run:\n{text}\n\n" +
                    "\n".join(h.output() for h in hosts.values()))


def test_sections_and_rewrite_rule():
    b = Block("hosts", "", "sh", "# every host: x\nmake venv && . a\n# once, on host A: y\nk\n"
              "# host A (10.0.0.1): z\nup --listen 0.0.0.0:7070 --peer 10.0.0.2:7070\n"
              "# host B (10.0.0.2)\nup --listen 0.0.0.0:7070 --peer 10.0.0.1:7070 --peer 10.9.9.9:7070\n", 1)
    got = steps(sections(b), ["A", "B"])
    assert [sorted(s) for s in got] == [["A", "B"], ["A"], ["A", "B"]]
    ports, addrs = {"A": 1001, "B": 1002}, {"A": "10.0.0.1", "B": "10.0.0.2"}
    assert rewrite(got[2]["A"][0], "A", ports, addrs) == "up --listen 127.0.0.1:1001 --peer 127.0.0.1:1002"
    assert rewrite(got[2]["B"][0], "B", ports, addrs) == \
        "up --listen 127.0.0.1:1002 --peer 127.0.0.1:1001 --peer 10.9.9.9:7070"


def test_readme_hosts_blocks_run_on_loopback(tmp_path):
    """The README's multi-machine blocks, in order, on one host session per machine."""
    text = README.read_text()
    addresses = declared_hosts(text)
    assert len(addresses) >= 2, f"the README's hosts blocks declare {addresses}; two machines at least"
    assert (ROOT / ".venv" / "bin" / "activate").is_file(), \
        "the README's hosts activate .venv: run the suite from `make test` (or after `make venv`)"
    names = list(addresses)
    ports = dict(zip(names, free_ports(len(names))))
    home = tmp_path / "home"
    home.mkdir()
    hosts: dict[str, Host] = {}
    try:
        for name in names:
            hosts[name] = Host(name, tmp_path, home)
        found = readme_blocks("hosts")
        for b in found:
            for i, step in enumerate(steps(sections(b), names)):
                concrete = {}
                for name, lines in step.items():
                    assert name in hosts, f"{b.where()}: host {name} has no '# host {name} (ADDRESS)' header"
                    out = []
                    for ln in lines:
                        ln = rewrite(ln, name, ports, addresses)
                        if re.match(r"\s*make\s", ln):
                            ln = check_make(ln.strip())
                        if ln.strip():
                            out.append(ln)
                    concrete[name] = out
                run_step(concrete, hosts, f"{b.where()}, step {i + 1}")
        # What the README says the hosts see: the run finished on both, and A's daemon lists B alive.
        log_a = hosts[names[0]].log_path.read_text(errors="replace")
        assert re.search(rf"peers\s+{len(names) - 1} alive of {len(names) - 1}", log_a), log_a[-3000:]
        for h in hosts.values():
            trainer_logs = " ".join(p.read_text(errors="replace") for p in h.data_dir.glob("trainer-*.log"))
            assert re.search(r"rank \d: accuracy 0\.\d+ on its own data after 300 iterations", trainer_logs), \
                h.output()
    finally:
        t0 = time.monotonic()
        for h in hosts.values():
            h.stop()
        print(f"hosts stopped in {time.monotonic() - t0:.1f} s")


# --- links in README.md and docs/ ----------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[`*]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)}


def broken_links(path: Path, others_missing: set[str], root: Path = ROOT) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):           # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
        if rel in others_missing:
            continue
        if not dest.exists():
            bad.append(f"{path.relative_to(root)}: {target} -> {rel} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(root)}: {target} -> no heading #{anchor} in {rel}")
    return bad


def doc_pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def test_relative_links_resolve():
    others_missing = {p for p in PAGES_OF_OTHERS if not (ROOT / p).exists()}
    if others_missing:
        print(f"not yet written by others, links to them skipped: {sorted(others_missing)}")
    bad = [b for p in doc_pages() if p.exists() for b in broken_links(p, others_missing)]
    assert not bad, "\n".join(bad)


def test_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n## A `code` heading, here\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Title\n[ok](other.md) [gone](no-such-page.md) [anchor](#title) [bad](#nope)\n"
                    "[sec](other.md#a-code-heading-here) [skipped](missing-of-others.md) `[code](x.md)`\n")
    bad = broken_links(page, {"docs/missing-of-others.md"}, root=tmp_path)
    assert len(bad) == 2 and "no-such-page.md" in bad[0] and "#nope" in bad[1], bad


def test_docs_pages_exist_and_the_readme_links_them():
    readme = README.read_text()
    for name in ("getting-started", "training", "multi-host", "links", "algorithms", "lab", "benchmarks",
                 "failure-model", "development"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
        assert f"(docs/{name}.md" in readme, f"README.md does not link docs/{name}.md"
    for page in PAGES_OF_OTHERS:
        assert f"({page})" in readme, f"README.md does not link {page}"
    assert (ROOT / "CHANGELOG.md").is_file()


def test_docs_shell_commands_parse():
    """Every `peerd ...` line in the shell blocks of our docs pages names real commands and options
    (run directories and files they name need not exist here)."""
    checked = 0
    for page in sorted(DOCS.glob("*.md")):
        if page.name in NOT_PARSED:
            continue
        for b in blocks(page.read_text()):
            if b.lang not in ("sh", "bash", "console"):
                continue
            for line in commands(b.text):
                for part in re.split(r"\s*(?:&&|;|\|\|)\s*", line):
                    argv = peerd_argv(part) if part else None
                    if argv is not None:
                        try:
                            parse_peerd(argv, tolerate_missing_paths=True)
                        except AssertionError as e:
                            raise AssertionError(f"docs/{page.name}:{b.line}: {e}") from None
                        checked += 1
    assert checked >= 20, checked


def test_no_history_in_the_docs():
    """Dates and before/after phrasing belong in CHANGELOG.md, not in the README or the docs."""
    bad = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        if page.name in NOT_PARSED:
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(r"\b20\d\d-\d\d-\d\d\b|\b(it|they) was\b|\(was [0-9]|\bused to\b", line):
                bad.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "history phrasing outside CHANGELOG.md:\n" + "\n".join(bad)



def test_lab_profile_examples_load(tmp_path):
    """The TOML profiles shown in docs/lab.md are profiles `peerd lab up --profile FILE` accepts."""
    from peerd.lab import profile

    found = [b for b in blocks((DOCS / "lab.md").read_text()) if b.lang == "toml"]
    assert found
    for i, b in enumerate(found):
        path = tmp_path / f"profile{i}.toml"
        path.write_text(b.text)
        p = profile.load(str(path))
        assert p.hosts, f"docs/lab.md:{b.line}: no hosts"
