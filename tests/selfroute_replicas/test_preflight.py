"""tests/selfroute/test_preflight.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_preflight import *  # noqa: F401,F403
