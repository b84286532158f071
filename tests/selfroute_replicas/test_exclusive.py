"""tests/selfroute/test_exclusive.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_exclusive import *  # noqa: F401,F403
