import pytest

from tests.daemons import daemons, secret_file  # noqa: F401  (fixtures)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item, so a fixture's teardown knows the test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
