"""tests/selfroute/test_trust_floor.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_trust_floor import *  # noqa: F401,F403
