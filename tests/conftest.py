from tests.daemons import daemons, secret_file  # noqa: F401  (fixtures)
