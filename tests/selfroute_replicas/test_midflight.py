"""tests/selfroute/test_midflight.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_midflight import *  # noqa: F401,F403
