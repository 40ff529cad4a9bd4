import signal

import pytest

from tests.daemons import daemons, secret_file  # noqa: F401  (fixtures)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item, so a fixture's teardown knows the test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def pytest_configure(config):
    """Tests send SIGINT (Ctrl+C) to the processes they start, which inherit an ignored SIGINT: a
    suite started as a background job of a non-interactive shell ignores SIGINT and SIGQUIT
    (POSIX), and then every `peerd train` it starts would too. Take the usual handlers back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
